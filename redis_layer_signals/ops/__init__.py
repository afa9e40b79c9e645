"""Operations: operator reads and cleanup (``admin``), the Prometheus exporter (``metrics``)
and the least-privilege ACL rules (``acl``). The ``rls`` command line is ``cli`` at the root."""
