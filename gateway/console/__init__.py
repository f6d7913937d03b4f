"""The SRE console at ``/console``: pages over the same services as the admin API, served by the
gateway itself (no build step; vendored, pinned JavaScript in ``static/vendor``)."""
