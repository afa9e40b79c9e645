"""The least-privilege ACL rules' public path (they live in ``ops.acl``)."""

from .ops.acl import ROLES, exporter_rules, key_pattern, rules

__all__ = ["ROLES", "exporter_rules", "key_pattern", "rules"]
