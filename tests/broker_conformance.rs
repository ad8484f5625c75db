//! The broker conformance suite (`leasehold::conformance`, feature `conformance`): the
//! in-process broker passes it, and brokers that break one rule each fail the check for that
//! rule (so the suite can fail).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use leasehold::conformance::Conformance;
use leasehold::{AcquireRequest, BrokerError, LocalBroker, SlotBroker, SlotToken};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_broker_passes_the_conformance_suite() {
    let report = Conformance::new(|| async { LocalBroker::new(3) })
        .run()
        .await;
    println!("{report}");
    report.assert_passed();
    let skipped: Vec<_> = report.checks().iter().filter_map(|c| c.skipped()).collect();
    // It renews nothing, so only the lost-lease check does not apply.
    assert_eq!(skipped, ["the broker does not renew leases"], "{report}");
}

/// A broker that breaks one rule of the contract (`Fault`), otherwise the in-process pool.
struct Faulty {
    pool: LocalBroker,
    fault: Fault,
    ids: AtomicU64,
    /// The token handed out for each of the pool's (lease ids that go down).
    renamed: Mutex<HashMap<SlotToken, SlotToken>>,
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Accepts a release of any token, granted or not.
    AcceptsAnyRelease,
    /// Hands out lease ids that go down.
    LeaseIdsGoDown,
    /// Its close fails.
    CloseFails,
}

impl Faulty {
    fn new(fault: Fault) -> Self {
        Self {
            pool: LocalBroker::new(3),
            fault,
            ids: AtomicU64::new(1_000),
            renamed: Mutex::new(HashMap::new()),
        }
    }
}

impl SlotBroker for Faulty {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        let token = self.pool.acquire(request).await?;
        if self.fault == Fault::LeaseIdsGoDown {
            // Unique, but each smaller than the last: no use as a fencing token.
            let id = self.ids.fetch_sub(1, Ordering::Relaxed);
            let renamed = SlotToken::new(token.slot_id(), id);
            self.renamed.lock().insert(renamed, token);
            return Ok(renamed);
        }
        Ok(token)
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        let token = match self.fault {
            Fault::LeaseIdsGoDown => match self.renamed.lock().remove(&token) {
                Some(pool) => pool,
                None => return Err(BrokerError::new(format!("{token} is not held"))),
            },
            _ => token,
        };
        let released = self.pool.release(token).await;
        match self.fault {
            Fault::AcceptsAnyRelease => Ok(()),
            _ => released,
        }
    }

    fn capacity(&self) -> Option<u32> {
        Some(3)
    }

    async fn close(&self) -> Result<(), BrokerError> {
        match self.fault {
            Fault::CloseFails => Err(BrokerError::unavailable("injected close failure")),
            _ => Ok(()),
        }
    }
}

async fn failed_checks(fault: Fault) -> Vec<&'static str> {
    let report = Conformance::new(move || async move { Faulty::new(fault) })
        .run()
        .await;
    println!("{report}");
    report
        .checks()
        .iter()
        .filter(|c| c.failure().is_some())
        .map(|c| c.name())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_accepts_a_release_of_a_token_it_never_granted_fails_the_bad_tokens_check() {
    assert_eq!(
        failed_checks(Fault::AcceptsAnyRelease).await,
        ["bad tokens"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_close_fails_fails_the_close_check() {
    assert_eq!(failed_checks(Fault::CloseFails).await, ["close"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_lease_ids_go_down_fails_the_fencing_check() {
    assert_eq!(failed_checks(Fault::LeaseIdsGoDown).await, ["fencing"]);
}
