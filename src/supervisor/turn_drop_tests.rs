//! A job whose GPU host has no sub-slot for it never runs, and its closure (the user's value)
//! is dropped off the supervisor's turn like every closure that never ran: a capture whose
//! `Drop` panics leaves the supervisor serving (invariant 9).
//!
//! The host is scripted at the seam the simulation uses (`Hosts::gpu`): the real pool answers
//! "no sub-slot" once every device it has is dead, after its re-creations failed.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::handle::Supervisor;
use crate::error::{JobError, PrepareError};
use crate::gpu::{GpuError, JobGpu, Placement};
use crate::hosts::{Fence, GpuHost, Hosts};
use crate::job::JobSpec;

/// A GPU host with one sub-slot that is never free (its only device is dead).
struct NoSubSlot;

impl GpuHost for NoSubSlot {
    fn capacity(&self) -> u32 {
        1
    }
    fn place(&self) -> Option<Placement> {
        None
    }
    fn free(&self, _slot: Placement) {
        unreachable!("nothing was placed")
    }
    fn checkout(&self, _slot: Placement) -> BoxFuture<'static, Result<Option<JobGpu>, GpuError>> {
        unreachable!("nothing was placed")
    }
    fn fence(&self, _slot: Placement, _job: Option<JobGpu>) -> BoxFuture<'static, Fence> {
        unreachable!("nothing was placed")
    }
    fn settled(&self, _device: usize) -> bool {
        true
    }
    fn recreate(&self, _device: usize) {}
    fn on_replaced(&self, _hook: Box<dyn Fn(usize, u64) + Send + Sync>) {}
    fn generation(&self, _device: usize) -> u64 {
        1
    }
    fn close(&self, _bound: Duration) -> BoxFuture<'static, Result<Vec<(usize, String)>, String>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// Panics when dropped, and says it was.
struct Bomb(Arc<AtomicBool>);

impl Drop for Bomb {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        panic!("a capture's drop panicked");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_with_no_gpu_sub_slot_has_its_closure_dropped_off_the_turn() {
    let mut hosts = Hosts::os();
    hosts.gpu = Some(Arc::new(NoSubSlot));
    let sup = Supervisor::builder()
        .slots(1)
        .hosts(hosts)
        .start()
        .await
        .unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let bomb = Bomb(Arc::clone(&dropped));
    let ran = Arc::new(AtomicBool::new(false));
    let body_ran = Arc::clone(&ran);
    let err = sup
        .run(JobSpec::new("no-sub-slot").unwrap(), move |_ctx| {
            let _bomb = bomb;
            body_ran.store(true, Ordering::SeqCst);
            async { Ok::<_, Infallible>(()) }
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            JobError::Unprepared {
                why: PrepareError::NoGpuSlot,
                cleanup: None
            }
        ),
        "{err:?}"
    );
    assert!(!ran.load(Ordering::SeqCst), "the body never ran");
    // The closure is dropped on the blocking pool; its panic is caught there.
    while !dropped.load(Ordering::SeqCst) {
        tokio::task::yield_now().await;
    }
    // The supervisor still serves: its slot came back, and a second job is answered the same.
    let stats = sup.stats();
    assert_eq!((stats.active, stats.waiting), (0, 0), "{stats:?}");
    let mut lease = sup.acquire().await.unwrap();
    lease.release().await.unwrap();
    let again = sup
        .run(JobSpec::new("again").unwrap(), |_ctx| async {
            Ok::<_, Infallible>(())
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), "LEASE_PREPARE_FAILED", "{again:?}");
    sup.shutdown().await.unwrap();
}
