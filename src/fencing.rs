//! Fencing tokens on the protected side: refuse a writer whose lease is older than the newest
//! one seen.
//!
//! A lease can be lost while its holder still runs (a process stopped past its TTL, a network
//! partition): another holder then gets the slot, and both may write. The brokers leasehold
//! ships hand out lease ids that increase strictly across the whole pool, so the resource they
//! protect can tell the two apart: it remembers the newest token it has accepted and refuses
//! any older one.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::broker::SlotToken;

/// Remembers the newest fencing token a protected resource has accepted, and refuses older
/// ones. Lock-free; share it (`Arc`) between everything that writes to the resource.
///
/// A token equal to the newest is accepted (the current holder writes more than once).
///
/// # Examples
///
/// ```
/// use leasehold::{FencingGuard, SlotToken};
///
/// let guard = FencingGuard::new();
/// let old = SlotToken::new(0, 41);
/// let new = SlotToken::new(0, 57);
/// guard.check(old).unwrap();
/// guard.check(new).unwrap();
/// let refused = guard.check(old).unwrap_err();
/// assert_eq!(refused.code(), "LEASE_FENCED");
/// assert_eq!(refused.newest(), 57);
/// ```
#[derive(Debug, Default)]
pub struct FencingGuard {
    newest: AtomicU64,
}

impl FencingGuard {
    /// A guard that has seen no token yet.
    pub const fn new() -> Self {
        Self {
            newest: AtomicU64::new(0),
        }
    }

    /// Accepts `token` if its lease id is at least the newest seen (and remembers it), or
    /// refuses it.
    ///
    /// # Errors
    ///
    /// [`StaleToken`] (code `LEASE_FENCED`) when a newer token has already been accepted.
    pub fn check(&self, token: SlotToken) -> Result<(), StaleToken> {
        self.check_id(token.lease_id())
    }

    /// [`check`](Self::check) for a bare fencing token (a lease id carried over the wire).
    ///
    /// # Errors
    ///
    /// [`StaleToken`] when a newer token has already been accepted.
    pub fn check_id(&self, fencing_token: u64) -> Result<(), StaleToken> {
        let before = self.newest.fetch_max(fencing_token, Ordering::AcqRel);
        if fencing_token < before {
            Err(StaleToken {
                token: fencing_token,
                newest: before,
            })
        } else {
            Ok(())
        }
    }

    /// The newest token accepted so far (0 before the first).
    pub fn newest(&self) -> u64 {
        self.newest.load(Ordering::Acquire)
    }
}

/// A fencing token older than one already accepted: its lease was lost and the slot has gone
/// to a newer holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleToken {
    token: u64,
    newest: u64,
}

impl StaleToken {
    /// `LEASE_FENCED`.
    pub fn code(&self) -> &'static str {
        crate::error::codes::LEASE_FENCED
    }

    /// The refused token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The newest token accepted before it.
    pub fn newest(&self) -> u64 {
        self.newest
    }
}

impl fmt::Display for StaleToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stale fencing token {}: token {} has already been accepted",
            self.token, self.newest
        )
    }
}

impl std::error::Error for StaleToken {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_older_than_the_newest_accepted_is_refused_and_equal_ones_pass() {
        let g = FencingGuard::new();
        assert!(g.check_id(5).is_ok());
        assert!(g.check_id(5).is_ok());
        assert!(g.check_id(9).is_ok());
        let e = g.check_id(7).unwrap_err();
        assert_eq!((e.token(), e.newest()), (7, 9));
        assert_eq!(g.newest(), 9, "a refused token does not lower the newest");
        assert!(g.check_id(10).is_ok());
    }

    #[test]
    fn concurrent_checks_never_accept_a_token_after_a_newer_one_was_accepted() {
        use std::sync::Arc;
        let g = Arc::new(FencingGuard::new());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let g = Arc::clone(&g);
                std::thread::spawn(move || {
                    let mut accepted = Vec::new();
                    for i in 0..1000u64 {
                        let tok = i * 4 + t;
                        if g.check_id(tok).is_ok() {
                            accepted.push(tok);
                        }
                    }
                    accepted
                })
            })
            .collect();
        for th in threads {
            let acc = th.join().unwrap();
            assert!(acc.windows(2).all(|w| w[0] < w[1]));
        }
        assert_eq!(g.newest(), 3999);
    }
}
