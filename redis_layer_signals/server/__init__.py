"""What the buffer checks of a server once, before it trusts it: the functions library
(``library``), the eviction policy, the durability settings and the ACL permissions."""
