//! The pool's layout in etcd — every key and value leasehold writes — and the validation of
//! everything it reads back: a key under the pool prefix that is not part of the layout is
//! `ETCD_FOREIGN_KEY`, a value leasehold did not write is `ETCD_CORRUPT_RECORD`.
//!
//! Under `{key_prefix}/{pool}/`:
//!
//! | key | value | lease |
//! |---|---|---|
//! | `capacity` | `leasehold/v1 capacity=N` | none |
//! | `request/{rk:016x}` | `leasehold/v1 request granted slot=N[ next=…]` or `… abandoned` | the requester's session |
//! | `queue/{qk:016x}` | `leasehold/v1 waiter owner={owner:016x} request={rk:016x}` | the waiter's session |
//! | `slot/{index:06}` | `leasehold/v1 holder request={rk:016x}` | the holder's session |
//!
//! `rk`, the request key, is derived from the broker's random owner id, the supervisor's origin
//! and the request id: it names the request's marker and its slot, which is what makes a retry
//! find its own work. A request has no marker while it waits: the marker is only ever its grant
//! (or, given up, its tombstone). A grant made by a release carries `next=`, the waiters after
//! the grantee that the releaser knew (at most [`NEXT_MAX`], oldest first, each
//! `{qk:016x}.{create revision:x}.{lease:x}.{rk:016x}`): the chain of the grantee's own release. `qk`, the place key, names a queue place: derived from the owner id and a
//! small index the broker reuses once a place is free, so that the queue's range holds a bounded
//! set of key names (etcd keeps every name a range ever held until it is compacted, and a range
//! read visits them all).

use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget};

use super::error::{EtcdError, EtcdErrorKind};

/// Marks every value leasehold writes (and refuses any other).
pub(super) const FORMAT: &str = "leasehold/v1";
/// The names directly under a pool's prefix. No part of a pool's own prefix may be one of
/// them: its keys would then lie inside another pool's slot, queue or request keys.
pub(super) const SECTIONS: [&str; 4] = ["capacity", "queue", "request", "slot"];
/// The largest pool an `EtcdBroker` manages (slot keys have six digits).
pub(super) const MAX_CAPACITY: u32 = 100_000;
/// The most waiters a grant's `next=` list names.
pub(super) const NEXT_MAX: usize = 8;

/// A slot key, read back: who holds slot `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) index: u32,
    /// The holder's request key.
    pub(super) rk: u64,
    /// The holder's session lease.
    pub(super) lease: i64,
    /// The revision of the grant: the token's lease id, and so its fencing token.
    pub(super) mod_rev: i64,
}

/// A queue key, read back: a waiter and its place (create revision).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Waiter {
    /// Its place key (names the queue key).
    pub(super) qk: u64,
    /// Its request key (names its marker).
    pub(super) rk: u64,
    pub(super) lease: i64,
    pub(super) create_rev: i64,
}

/// Where a request stands, as its `request/` key says (a request that waits has none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MarkerState {
    /// Holds slot `slot`, granted at the key's mod revision.
    Granted { slot: u32 },
    /// Given up: the key stays as a tombstone so that a late copy of the request's first
    /// transaction finds it and does nothing.
    Abandoned,
}

/// A `request/` key, read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Marker {
    pub(super) state: MarkerState,
    pub(super) lease: i64,
    pub(super) mod_rev: i64,
}

/// What a grant written into a waiter's marker was checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Confirmed {
    /// The slot key says the same: written by leasehold for this request, under this session,
    /// at the marker's revision.
    Held,
    /// The slot key is gone (with its session, or deleted by someone else).
    Missing,
}

/// The parts of a key-value pair that validation looks at (a `KeyValue` read from etcd, or one
/// built by hand in a unit test).
#[derive(Debug, Clone, Copy)]
pub(super) struct Raw<'a> {
    pub(super) key: &'a [u8],
    pub(super) value: &'a [u8],
    pub(super) lease: i64,
    pub(super) create_rev: i64,
    pub(super) mod_rev: i64,
}

/// The key-value pairs of a read, as [`Raw`].
pub(super) fn raws(kvs: &[KeyValue]) -> impl Iterator<Item = Raw<'_>> {
    kvs.iter().map(Raw::from)
}

impl<'a> From<&'a KeyValue> for Raw<'a> {
    fn from(kv: &'a KeyValue) -> Self {
        Raw {
            key: kv.key(),
            value: kv.value(),
            lease: kv.lease(),
            create_rev: kv.create_revision(),
            mod_rev: kv.mod_revision(),
        }
    }
}

/// The pool's keys and values, and their validation.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    /// `{key_prefix}/{pool}/`.
    prefix: String,
    capacity: u32,
}

impl Layout {
    pub(super) fn new(key_prefix: &str, pool: &str, capacity: u32) -> Self {
        Self {
            prefix: format!("{key_prefix}/{pool}/"),
            capacity,
        }
    }

    pub(super) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(super) fn capacity(&self) -> u32 {
        self.capacity
    }

    pub(super) fn capacity_key(&self) -> String {
        format!("{}capacity", self.prefix)
    }

    pub(super) fn capacity_value(&self) -> String {
        format!("{FORMAT} capacity={}", self.capacity)
    }

    pub(super) fn queue_prefix(&self) -> String {
        format!("{}queue/", self.prefix)
    }

    pub(super) fn queue_key(&self, qk: u64) -> String {
        format!("{}queue/{qk:016x}", self.prefix)
    }

    pub(super) fn slot_prefix(&self) -> String {
        format!("{}slot/", self.prefix)
    }

    /// The capacity keys of the pools this pool's prefix would nest in: for
    /// `a/b/c/pool/`, `a/b/capacity` and `a/b/c/capacity` (a pool's prefix has at least two
    /// parts, its key prefix and its name).
    pub(super) fn enclosing_capacity_keys(&self) -> Vec<String> {
        let parts: Vec<&str> = self.prefix.trim_end_matches('/').split('/').collect();
        (2..parts.len())
            .map(|n| format!("{}/capacity", parts[..n].join("/")))
            .collect()
    }

    pub(super) fn slot_key(&self, index: u32) -> String {
        format!("{}slot/{index:06}", self.prefix)
    }

    /// The index of slot key `key` of this pool, if it is one (a key that is not is left to
    /// [`holder`](Self::holder) to refuse).
    pub(super) fn slot_index(&self, key: &[u8]) -> Option<u32> {
        let rest = key
            .strip_prefix(self.prefix.as_bytes())?
            .strip_prefix(b"slot/".as_slice())?;
        if rest.len() != 6 || !rest.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let index = std::str::from_utf8(rest).ok()?.parse::<u32>().ok()?;
        (index < self.capacity).then_some(index)
    }

    pub(super) fn request_key(&self, rk: u64) -> String {
        format!("{}request/{rk:016x}", self.prefix)
    }

    pub(super) fn waiter_value(&self, owner: u64, rk: u64) -> String {
        format!("{FORMAT} waiter owner={owner:016x} request={rk:016x}")
    }

    pub(super) fn holder_value(&self, rk: u64) -> String {
        format!("{FORMAT} holder request={rk:016x}")
    }

    pub(super) fn marker_value(&self, state: MarkerState) -> String {
        match state {
            MarkerState::Granted { slot } => format!("{FORMAT} request granted slot={slot}"),
            MarkerState::Abandoned => format!("{FORMAT} request abandoned"),
        }
    }

    /// A grant of `slot` that names `next` (at most [`NEXT_MAX`] of them), the waiters after
    /// the grantee that the releaser knew, oldest first.
    pub(super) fn grant_value(&self, slot: u32, next: &[Waiter]) -> String {
        use std::fmt::Write;
        let mut value = self.marker_value(MarkerState::Granted { slot });
        for (i, w) in next.iter().take(NEXT_MAX).enumerate() {
            value.push_str(if i == 0 { " next=" } else { "," });
            let _ = write!(
                value,
                "{:016x}.{:x}.{:x}.{:016x}",
                w.qk, w.create_rev, w.lease as u64, w.rk
            );
        }
        value
    }

    pub(super) fn foreign(&self, kv: Raw<'_>, why: &str) -> EtcdError {
        EtcdError::new(
            EtcdErrorKind::ForeignKey,
            format!(
                "key {} under the pool prefix {:?} was not written by leasehold ({why}); remove it or use another pool",
                shown(kv.key),
                self.prefix
            ),
        )
    }

    fn corrupt(&self, kv: Raw<'_>, why: &str) -> EtcdError {
        EtcdError::new(
            EtcdErrorKind::CorruptRecord,
            format!(
                "key {} holds {} ({why}); leasehold refuses to use the pool",
                shown(kv.key),
                shown(kv.value)
            ),
        )
    }

    /// The part of `kv`'s key after `{prefix}{section}`.
    fn rest<'a>(&self, kv: Raw<'a>, section: &str) -> Result<&'a str, EtcdError> {
        kv.key
            .strip_prefix(self.prefix.as_bytes())
            .and_then(|k| k.strip_prefix(section.as_bytes()))
            .and_then(|k| std::str::from_utf8(k).ok())
            .ok_or_else(|| self.foreign(kv, "outside the layout"))
    }

    /// A key of the `slot/` range.
    pub(super) fn holder<'a>(&self, kv: impl Into<Raw<'a>>) -> Result<Holder, EtcdError> {
        let kv = kv.into();
        let rest = self.rest(kv, "slot/")?;
        let index = (rest.len() == 6 && rest.bytes().all(|b| b.is_ascii_digit()))
            .then(|| rest.parse::<u32>().ok())
            .flatten()
            .ok_or_else(|| self.foreign(kv, "not a slot key"))?;
        if index >= self.capacity {
            return Err(self.corrupt(kv, "slot index beyond the pool's capacity"));
        }
        let rk = std::str::from_utf8(kv.value)
            .ok()
            .and_then(|v| v.strip_prefix(FORMAT))
            .and_then(|v| v.strip_prefix(" holder request="))
            .and_then(parse_hex)
            .filter(|_| kv.lease != 0)
            .ok_or_else(|| self.corrupt(kv, "not a holder record under a lease"))?;
        Ok(Holder {
            index,
            rk,
            lease: kv.lease,
            mod_rev: kv.mod_rev,
        })
    }

    /// A key of the `queue/` range.
    pub(super) fn waiter<'a>(&self, kv: impl Into<Raw<'a>>) -> Result<Waiter, EtcdError> {
        let kv = kv.into();
        let rest = self.rest(kv, "queue/")?;
        let qk = parse_hex(rest).ok_or_else(|| self.foreign(kv, "not a queue key"))?;
        let rk = std::str::from_utf8(kv.value)
            .ok()
            .and_then(|v| v.strip_prefix(FORMAT))
            .and_then(|v| v.strip_prefix(" waiter owner="))
            .and_then(|v| v.split_once(" request="))
            .filter(|(owner, _)| parse_hex(owner).is_some())
            .and_then(|(_, rk)| parse_hex(rk))
            .filter(|_| kv.lease != 0)
            .ok_or_else(|| self.corrupt(kv, "not a waiter record under a lease"))?;
        Ok(Waiter {
            qk,
            rk,
            lease: kv.lease,
            create_rev: kv.create_rev,
        })
    }

    /// A key of the `request/` range.
    pub(super) fn marker<'a>(&self, kv: impl Into<Raw<'a>>) -> Result<Marker, EtcdError> {
        let kv = kv.into();
        let rest = self.rest(kv, "request/")?;
        parse_hex(rest).ok_or_else(|| self.foreign(kv, "not a request key"))?;
        let (state, _) = self
            .marker_parts(kv.value)
            .filter(|_| kv.lease != 0)
            .ok_or_else(|| self.corrupt(kv, "not a request record under a lease"))?;
        Ok(Marker {
            state,
            lease: kv.lease,
            mod_rev: kv.mod_rev,
        })
    }

    /// The waiters a grant's marker names after the grantee (see [`grant_value`]): none for a
    /// grant without a list, or for anything that is not a grant leasehold wrote.
    ///
    /// [`grant_value`]: Self::grant_value
    pub(super) fn next_of(&self, value: &[u8]) -> Vec<Waiter> {
        self.marker_parts(value)
            .map_or_else(Vec::new, |(_, next)| next)
    }

    /// A marker's value: its state and, for a grant, the waiters it names after the grantee.
    fn marker_parts(&self, value: &[u8]) -> Option<(MarkerState, Vec<Waiter>)> {
        let v = std::str::from_utf8(value)
            .ok()?
            .strip_prefix(FORMAT)?
            .strip_prefix(" request ")?;
        if v == "abandoned" {
            return Some((MarkerState::Abandoned, Vec::new()));
        }
        let v = v.strip_prefix("granted slot=")?;
        let (slot, next) = match v.split_once(" next=") {
            Some((slot, next)) => (slot, Some(next)),
            None => (v, None),
        };
        if slot.is_empty() || !slot.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let slot = slot.parse::<u32>().ok().filter(|n| *n < self.capacity)?;
        let next = match next {
            None => Vec::new(),
            Some(list) => {
                let next = list
                    .split(',')
                    .map(parse_next)
                    .collect::<Option<Vec<Waiter>>>()?;
                if next.len() > NEXT_MAX {
                    return None;
                }
                next
            }
        };
        Some((MarkerState::Granted { slot }, next))
    }

    /// A grant that a waiter's marker says it has (`marker`, already read as this request's,
    /// under `session`), checked against its slot key (`slot`, read after it): the slot key must
    /// be a holder record of this request (`rk`), under the same session, written at the
    /// marker's revision — the one transaction that grants writes both. Anything else is a
    /// value leasehold did not write for this grant (`ETCD_CORRUPT_RECORD`).
    pub(super) fn confirm_grant(
        &self,
        rk: u64,
        session: i64,
        marker: &Marker,
        slot: Option<Raw<'_>>,
    ) -> Result<Confirmed, EtcdError> {
        let MarkerState::Granted { slot: index } = marker.state else {
            return Err(EtcdError::new(
                EtcdErrorKind::InvalidResponse,
                format!("request {rk:016x} was asked to confirm a grant it does not have"),
            ));
        };
        if marker.lease != session {
            return Err(self.not_ours(rk, marker.lease, session));
        }
        let Some(kv) = slot else {
            return Ok(Confirmed::Missing);
        };
        let holder = self.holder(kv)?;
        if kv.key != self.slot_key(index).as_bytes()
            || holder.rk != rk
            || holder.lease != session
            || holder.mod_rev != marker.mod_rev
        {
            return Err(self.corrupt(
                kv,
                &format!(
                    "not the grant of slot {index} to request {rk:016x} under session {session:016x} at revision {}",
                    marker.mod_rev
                ),
            ));
        }
        Ok(Confirmed::Held)
    }

    /// A request's marker written under another lease than the waiter's session: not a record
    /// leasehold wrote for this waiter.
    pub(super) fn not_ours(&self, rk: u64, lease: i64, session: i64) -> EtcdError {
        EtcdError::new(
            EtcdErrorKind::CorruptRecord,
            format!(
                "key {:?} was written under lease {lease:016x}, not this waiter's session {session:016x}: leasehold did not write it; it grants nothing",
                self.request_key(rk)
            ),
        )
    }

    /// The `capacity` key: refused unless it records this broker's capacity.
    pub(super) fn check_capacity(&self, kv: Option<Raw<'_>>) -> Result<(), EtcdError> {
        let Some(kv) = kv else {
            return Err(EtcdError::new(
                EtcdErrorKind::CorruptRecord,
                format!("the capacity record {:?} is missing", self.capacity_key()),
            ));
        };
        let n = std::str::from_utf8(kv.value)
            .ok()
            .and_then(|v| v.strip_prefix(FORMAT))
            .and_then(|v| v.strip_prefix(" capacity="))
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|n| (1..=MAX_CAPACITY).contains(n))
            .ok_or_else(|| self.corrupt(kv, "not a capacity record"))?;
        if n != self.capacity {
            return Err(EtcdError::new(
                EtcdErrorKind::CapacityMismatch,
                format!(
                    "pool {:?} was created with capacity {n}, this broker is configured with {}",
                    self.prefix, self.capacity
                ),
            ));
        }
        Ok(())
    }

    /// Validates every key of the pool (read at `connect`): each must be part of the layout
    /// and hold what leasehold writes there, and a pool with any key must have its capacity
    /// record (a missing one is never re-created under slots in use).
    pub(super) fn check_pool<'a>(
        &self,
        kvs: impl IntoIterator<Item = Raw<'a>>,
    ) -> Result<(), EtcdError> {
        let capacity_key = self.capacity_key();
        let (slot, queue, request) = (
            self.slot_prefix(),
            self.queue_prefix(),
            format!("{}request/", self.prefix),
        );
        let mut capacity = None;
        let mut others = 0usize;
        for kv in kvs {
            let key = kv.key;
            if key == capacity_key.as_bytes() {
                capacity = Some(kv);
                continue;
            }
            others += 1;
            if key.starts_with(slot.as_bytes()) {
                self.holder(kv)?;
            } else if key.starts_with(queue.as_bytes()) {
                self.waiter(kv)?;
            } else if key.starts_with(request.as_bytes()) {
                self.marker(kv)?;
            } else if key.starts_with(self.prefix.as_bytes()) {
                return Err(self.foreign(kv, "unknown key"));
            } else {
                return Err(self.foreign(kv, "outside the prefix"));
            }
        }
        if capacity.is_none() && others > 0 {
            return Err(EtcdError::new(
                EtcdErrorKind::CorruptRecord,
                format!(
                    "the capacity record {capacity_key:?} is missing while the pool has {others} other keys: it is not re-created under slots that may be in use; restore it (`leasehold/v1 capacity=N`) or empty the pool"
                ),
            ));
        }
        self.check_capacity(capacity)
    }

    /// Every slot key of a `slot/` range read, validated. A key that is not exactly one of the
    /// pool's slot keys (`slot/notes`, `slot/000001.bak`, an index beyond the capacity) is
    /// ignored: it holds no slot, whoever wrote it.
    pub(super) fn holders<'a>(
        &self,
        kvs: impl IntoIterator<Item = Raw<'a>>,
    ) -> Result<Vec<Holder>, EtcdError> {
        kvs.into_iter()
            .filter(|kv| self.slot_index(kv.key).is_some())
            .map(|kv| self.holder(kv))
            .collect()
    }

    /// How many of the keys of a `slot/` range read are exactly slot keys of the pool: the
    /// slots held (see [`holders`](Self::holders)).
    pub(super) fn held_among<'a>(&self, keys: impl IntoIterator<Item = &'a [u8]>) -> i64 {
        keys.into_iter()
            .filter(|key| self.slot_index(key).is_some())
            .count() as i64
    }

    /// Every queue key of a `queue/` range read, validated. A key that is not exactly a queue
    /// key (`queue/notes`) is ignored: it waits for nothing, whoever wrote it.
    pub(super) fn waiters<'a>(
        &self,
        kvs: impl IntoIterator<Item = Raw<'a>>,
    ) -> Result<Vec<Waiter>, EtcdError> {
        kvs.into_iter()
            .filter(|kv| self.is_queue_key(kv.key))
            .map(|kv| self.waiter(kv))
            .collect()
    }

    /// Whether `key` is exactly a queue key of this pool (`queue/` and sixteen lowercase hex
    /// digits, as leasehold writes them).
    pub(super) fn is_queue_key(&self, key: &[u8]) -> bool {
        key.strip_prefix(self.prefix.as_bytes())
            .and_then(|k| k.strip_prefix(b"queue/".as_slice()))
            .is_some_and(|rest| {
                rest.len() == 16 && rest.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            })
    }
}

fn shown(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    let mut out: String = s.chars().take(120).collect();
    if s.chars().count() > 120 {
        out.push('…');
    }
    format!("{out:?}")
}

/// A read of the queue's `n` oldest waiters, oldest first (under [`Layout::queue_prefix`]): the
/// queue's order is its keys' create revisions, and every read of its head uses this one.
pub(super) fn oldest_waiters(n: i64) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(n)
}

/// One waiter of a grant's `next=` list: `{qk:016x}.{create revision:x}.{lease:x}.{rk:016x}`,
/// lowercase, with a positive revision and lease.
fn parse_next(entry: &str) -> Option<Waiter> {
    let mut parts = entry.split('.');
    let (qk, rev, lease, rk) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let short_hex = |s: &str| {
        (!s.is_empty()
            && s.len() <= 16
            && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
        .and_then(|x| i64::try_from(x).ok())
        .filter(|x| *x > 0)
    };
    let long_hex = |s: &str| {
        (s.len() == 16 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| u64::from_str_radix(s, 16).ok())
            .flatten()
    };
    Some(Waiter {
        qk: long_hex(qk)?,
        rk: long_hex(rk)?,
        lease: short_hex(lease)?,
        create_rev: short_hex(rev)?,
    })
}

/// Exactly sixteen hex digits.
pub(super) fn parse_hex(hex: &str) -> Option<u64> {
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// splitmix64's finaliser: a bijection, so distinct inputs give distinct outputs.
pub(super) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The request key of `(owner, origin, request_id)`: what names a request's marker and slot.
pub(super) fn request_key(owner: u64, origin: u64, request_id: u64) -> u64 {
    mix(owner ^ mix(origin) ^ mix(mix(request_id)))
}

/// The place key of the broker `owner`'s queue place number `index`.
pub(super) fn place_key(owner: u64, index: u32) -> u64 {
    mix(mix(owner) ^ mix(u64::from(index) + 1))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn request_keys_differ_per_request_and_per_origin() {
        let keys: HashSet<u64> = (0..10_000u64)
            .flat_map(|r| [request_key(42, 1, r), request_key(42, 2, r)])
            .collect();
        assert_eq!(keys.len(), 20_000);
    }

    #[test]
    fn place_keys_differ_per_place_and_per_owner() {
        // Owners are random 64-bit ids.
        let (a, b) = (0x1234_5678_9abc_def0, 0x0fed_cba9_8765_4321);
        let keys: HashSet<u64> = (0..1_000u32)
            .flat_map(|i| [place_key(a, i), place_key(b, i)])
            .collect();
        assert_eq!(keys.len(), 2_000);
    }

    #[test]
    fn only_the_pools_own_slot_keys_have_a_slot_index() {
        let layout = Layout::new("leasehold", "p", 8);
        assert_eq!(layout.slot_index(layout.slot_key(7).as_bytes()), Some(7));
        for key in [
            "leasehold/p/slot/000008",
            "leasehold/p/slot/notes",
            "leasehold/p/slot/00001",
            "leasehold/q/slot/000001",
            "leasehold/p/queue/000001",
        ] {
            assert_eq!(layout.slot_index(key.as_bytes()), None, "{key}");
        }
    }

    #[test]
    fn hex_parsing_refuses_anything_but_sixteen_hex_digits() {
        assert_eq!(parse_hex("000000000000002a"), Some(42));
        assert_eq!(parse_hex("ffffffffffffffff"), Some(u64::MAX));
        for bad in ["2a", "000000000000002g", "000000000000002a0"] {
            assert_eq!(parse_hex(bad), None, "{bad}");
        }
    }

    fn raw<'a>(key: &'a str, value: &'a str, lease: i64) -> Raw<'a> {
        Raw {
            key: key.as_bytes(),
            value: value.as_bytes(),
            lease,
            create_rev: 5,
            mod_rev: 9,
        }
    }

    #[test]
    fn every_value_leasehold_writes_reads_back_as_what_it_says() {
        let layout = Layout::new("leasehold", "p", 8);
        for state in [MarkerState::Granted { slot: 7 }, MarkerState::Abandoned] {
            let (key, value) = (layout.request_key(3), layout.marker_value(state));
            let marker = layout.marker(raw(&key, &value, 11)).unwrap();
            assert_eq!((marker.state, marker.lease, marker.mod_rev), (state, 11, 9));
        }
        let (key, value) = (layout.slot_key(7), layout.holder_value(0xabc));
        let holder = layout.holder(raw(&key, &value, 11)).unwrap();
        assert_eq!(
            holder,
            Holder {
                index: 7,
                rk: 0xabc,
                lease: 11,
                mod_rev: 9
            }
        );
        let (key, value) = (layout.queue_key(0xabc), layout.waiter_value(1, 0xdef));
        let waiter = layout.waiter(raw(&key, &value, 11)).unwrap();
        assert_eq!(
            (waiter.qk, waiter.rk, waiter.lease, waiter.create_rev),
            (0xabc, 0xdef, 11, 5)
        );
    }

    #[test]
    fn a_grants_list_of_the_waiters_after_the_grantee_reads_back_and_nothing_else_does() {
        let layout = Layout::new("leasehold", "p", 8);
        let waiter = |i: u64| Waiter {
            qk: 0xa0 + i,
            rk: 0xb0 + i,
            lease: 0x7000 + i as i64,
            create_rev: 40 + i as i64,
        };
        let next: Vec<Waiter> = (1..=3).map(waiter).collect();
        let (key, value) = (layout.request_key(3), layout.grant_value(5, &next));
        let marker = layout.marker(raw(&key, &value, 11)).unwrap();
        assert_eq!(marker.state, MarkerState::Granted { slot: 5 });
        assert_eq!(layout.next_of(value.as_bytes()), next);
        assert_eq!(
            layout.grant_value(5, &[]),
            layout.marker_value(MarkerState::Granted { slot: 5 })
        );
        // At most NEXT_MAX are named.
        let many: Vec<Waiter> = (1..=20).map(waiter).collect();
        let value = layout.grant_value(5, &many);
        assert_eq!(layout.next_of(value.as_bytes()), many[..NEXT_MAX].to_vec());
        let entry = "00000000000000a1.29.7001.00000000000000b1";
        let nine = [entry; NEXT_MAX + 1].join(",");
        for bad in [
            " next=".to_owned(),
            format!(" next={entry},"),
            " next=00000000000000a1.29.7001".to_owned(),
            " next=00000000000000A1.29.7001.00000000000000b1".to_owned(),
            " next=00000000000000a1.0.7001.00000000000000b1".to_owned(),
            " next=00000000000000a1.29.0.00000000000000b1".to_owned(),
            " next=00000000000000a1.29.8000000000000000.00000000000000b1".to_owned(),
            " next=0a1.29.7001.00000000000000b1".to_owned(),
            format!(" next={entry}.1"),
            format!(" next={entry} "),
            format!(" next={nine}"),
            " next=00000000000000a1.+29.7001.00000000000000b1".to_owned(),
        ] {
            let value = format!("leasehold/v1 request granted slot=5{bad}");
            assert_eq!(
                layout.marker(raw(&key, &value, 11)).unwrap_err().code(),
                "ETCD_CORRUPT_RECORD",
                "{value}"
            );
        }
        // No marker says a request waits: a request that waits has none.
        let waiting = "leasehold/v1 request waiting";
        assert_eq!(
            layout.marker(raw(&key, waiting, 11)).unwrap_err().code(),
            "ETCD_CORRUPT_RECORD"
        );
    }

    #[test]
    fn keys_outside_the_layout_are_foreign_and_values_it_did_not_write_are_corrupt() {
        let layout = Layout::new("leasehold", "p", 8);
        let code = |e: EtcdError| e.code();
        let holder = layout.holder_value(1);
        // Foreign: a key in a section that is not one of the layout's.
        assert_eq!(
            code(
                layout
                    .holder(raw("leasehold/p/slot/notes", &holder, 1))
                    .unwrap_err()
            ),
            "ETCD_FOREIGN_KEY"
        );
        assert_eq!(
            code(
                layout
                    .waiter(raw(
                        "leasehold/p/queue/2a",
                        "leasehold/v1 waiter owner=0",
                        1
                    ))
                    .unwrap_err()
            ),
            "ETCD_FOREIGN_KEY"
        );
        // Corrupt: no lease, an index beyond the capacity, another format.
        for (key, value, lease) in [
            ("leasehold/p/slot/000001", holder.as_str(), 0),
            ("leasehold/p/slot/000008", holder.as_str(), 1),
            (
                "leasehold/p/slot/000001",
                "leasehold/v1 holder lease=000000000000002a",
                1,
            ),
        ] {
            assert_eq!(
                code(layout.holder(raw(key, value, lease)).unwrap_err()),
                "ETCD_CORRUPT_RECORD",
                "{key} {value}"
            );
        }
        for value in [
            "leasehold/v1 request granted slot=8",
            "leasehold/v1 request granted slot=x",
            "leasehold/v1 request",
            "hello",
        ] {
            let key = layout.request_key(1);
            assert_eq!(
                code(layout.marker(raw(&key, value, 1)).unwrap_err()),
                "ETCD_CORRUPT_RECORD",
                "{value}"
            );
        }
    }
}
