"""Transport: clients from URLs, Cluster routing, the call's deadline, bounded resending,
synchronous replication and the direct wire (FCALL packed by hiredis). A packed call goes in,
a raw reply comes out."""
