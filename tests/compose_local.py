"""Run services of docker-compose.yml as local processes, the way the file starts them: the
command, arguments and environment come from the parsed file (``docker-compose config``); only
the addresses change, from ``service:container-port`` to ``127.0.0.1:<free port>``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REDIS_PORT = 6379
"""The port every Redis of the file listens on inside its container."""


def unescape(value: str) -> str:
    """Compose writes a literal ``$`` as ``$$``; the container's shell sees one."""
    return value.replace("$$", "$")


class Addresses:
    """``service:port`` of the compose network -> ``127.0.0.1:local port`` on this machine."""

    def __init__(self) -> None:
        self.ports: dict[tuple[str, int], int] = {}

    def add(self, service: str, port: int, local_port: int) -> None:
        self.ports[(service, port)] = local_port

    def localize(self, value: str) -> str:
        """Rewrite every ``service:port`` the map knows in ``value`` (URLs, address lists)."""

        def replace(match: re.Match[str]) -> str:
            local = self.ports.get((match.group(1), int(match.group(2))))
            return match.group(0) if local is None else f"127.0.0.1:{local}"

        return re.sub(r"\b([a-z][a-z0-9-]*):(\d+)\b", replace, value)

    def localize_args(self, args: list[str]) -> list[str]:
        """Also ``--replicaof <service> <port>``: a host and a port as two arguments."""
        result = [self.localize(a) for a in args]
        for i in range(len(result) - 1):
            local = self.ports.get((result[i], int(result[i + 1]) if result[i + 1].isdigit() else -1))
            if local is not None:
                result[i], result[i + 1] = "127.0.0.1", str(local)
        return result


class LocalServices:
    """Starts services as processes and ends every one of them in ``cleanup``."""

    def __init__(self, compose: Mapping[str, Any], addresses: Addresses) -> None:
        self.services: Mapping[str, Any] = compose["services"]
        self.addresses = addresses
        self.processes: list[subprocess.Popen[str]] = []
        self.workdirs: list[Path] = []
        self.logs: dict[subprocess.Popen[str], Path] = {}
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}

    def environment(self, name: str, **overrides: str) -> dict[str, str]:
        service_env = {
            k: self.addresses.localize(str(v)) for k, v in self.services[name].get("environment", {}).items()
        }
        return {**self.base_env, **service_env, **overrides}

    def start_rls(self, name: str) -> subprocess.Popen[str]:
        """An ``rls ...`` service: the same command through this interpreter."""
        command = self.services[name]["command"]
        assert command[0] == "rls", command
        args = [sys.executable, "-m", "redis_layer_signals", *self.addresses.localize_args(command[1:])]
        return self.popen(args, self.environment(name, COLUMNS="200"))

    def start_shell(self, name: str, **overrides: str) -> subprocess.Popen[str]:
        """An ``sh -c ...`` service, in a directory of its own (its container's working dir)."""
        command = [unescape(part) for part in self.services[name]["command"]]
        assert command[:2] == ["sh", "-c"], command
        workdir = Path(tempfile.mkdtemp(prefix=f"rls-compose-{name}-"))
        self.workdirs.append(workdir)
        # A long-running server logs to a file, not to a pipe nobody reads.
        with open(workdir / "output.log", "w") as log:
            process = subprocess.Popen(command, env=self.environment(name, **overrides), cwd=workdir, stdout=log,
                                       stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.processes.append(process)
        self.logs[process] = workdir / "output.log"
        return process

    def popen(self, args: list[str], env: dict[str, str], cwd: str | Path = ROOT) -> subprocess.Popen[str]:
        process = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.processes.append(process)
        return process

    def output(self, process: subprocess.Popen[str]) -> str:
        """What a shell service printed (its log file)."""
        return self.logs[process].read_text()

    def cleanup(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        for workdir in self.workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def redis_args(service: Mapping[str, Any], addresses: Addresses) -> list[str]:
    """A Redis service's arguments after ``redis-server`` (the tests' servers pick the port)."""
    command: list[str] = service["command"]
    assert command[0] == "redis-server", command
    assert "--port" not in command, "the containers listen on 6379; the tests choose the port"
    return addresses.localize_args(command[1:])


def profile_services(compose: Mapping[str, Any], profile: str | None) -> dict[str, Any]:
    """The services of one profile (``None``: the services without a profile)."""
    return {
        name: service
        for name, service in compose["services"].items()
        if (profile is None and not service.get("profiles")) or profile in service.get("profiles", [])
    }
