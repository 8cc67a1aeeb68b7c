"""Host leases, the NIXL read path of the segment store: a reader is handed an entry's bytes
in host memory, and the entry cannot be evicted until the lease is released.

A mixin of SegmentStore (store.py): it works on the store's index under the store's `_lock`, and
uses its tier bookkeeping (`_track`, `_untrack`, `_hit`, `_count_read`) and disk read
(`_get_from_disk`). Kept apart because it is its own concept with its own accounting
(`leases_active`, `staging_bytes`).
"""

from __future__ import annotations

import numpy as np

from services.segcache.records import TIER_DEVICE, TIER_HOST, Entry, HostLease


class HostLeases:
    """acquire_host / release_host of SegmentStore."""

    staging_bytes: int  # private lease copies outside the host tier
    leases_active: int

    def _lease_host(self, e: Entry, arr: np.ndarray, staged: bool) -> HostLease:
        e.leases += 1
        if e.leases == 1:
            self._untrack(e)
        if staged:
            self.staging_bytes += e.size
        self.leases_active += 1
        return HostLease(e, arr, staged)

    def acquire_host(self, key: str) -> HostLease | None:
        """Make key's bytes available in host memory for a remote reader and pin them there
        until release_host(). Counts as a read. None on a miss (or a corrupt disk copy)."""
        tensor = None
        with self._lock:
            e = self._entry_to_read(key)
            if e is None:
                return None
            if e.host is not None:
                self._hit(e, TIER_HOST)
                return self._lease_host(e, e.host, staged=False)
            if key in self._pending:
                self._hit(e, TIER_HOST)
                return self._lease_host(e, self._pending[key], staged=True)
            if e.device is not None:
                self._hit(e, TIER_DEVICE)
                tensor = e.device
        if tensor is not None:
            arr = tensor.cpu().numpy()
            with self._lock:
                return self._lease_host(e, arr, staged=True)
        got = self._get_from_disk(e)
        if got is None:
            return None
        with self._lock:
            cur = self._entries.get(key)
            if cur is e and e.host is not None:
                return self._lease_host(e, e.host, staged=False)
            return self._lease_host(e, got[1], staged=True)

    def release_host(self, lease: HostLease) -> None:
        with self._lock:
            e = lease.entry
            e.leases -= 1
            self.leases_active -= 1
            if lease.staged:
                self.staging_bytes -= e.size
            if e.leases == 0:
                if e.deleted:
                    if e.host is not None:  # the deleted entry's host buffer is freed now
                        self.host.sub(e.size, e.format, count=False)
                        e.host = None
                elif self._entries.get(e.key) is e:
                    self._track(e)
