"""The protocol: the key layout, each call packed as a function call, and its reply parsed.

``calls`` checks a call's arguments and packs it (``ScriptCall``), ``keys`` names its keys,
``replies`` turns the function's reply into the public result types, ``counters`` reads a
rank's ``stats`` hash. Nothing here talks to a server.
"""
