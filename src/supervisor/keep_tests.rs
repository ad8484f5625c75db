//! What the shell keeps of a caller or a lease (its waiter entry, an explicit lease's cell and
//! `release` replies, a running job, a renewal) goes with it: once every caller has been
//! answered and every lease has ended, the shell holds nothing, whatever kind the leases were.

use std::convert::Infallible;
use std::sync::atomic::Ordering;

use super::handle::Supervisor;
use crate::job::JobSpec;

fn kept(sup: &Supervisor) -> u64 {
    sup.inner().stats.shell_entries.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_kept_of_a_job_or_an_explicit_lease_once_it_has_ended() {
    let sup = Supervisor::builder().slots(2).start().await.unwrap();
    // Explicit leases, alone and two at once (the second map entry makes the map non-empty
    // when the first ends).
    let mut one = sup.acquire().await.unwrap();
    assert_eq!(kept(&sup), 1, "a held explicit lease is kept");
    let mut two = sup.acquire().await.unwrap();
    one.release().await.unwrap();
    assert_eq!(kept(&sup), 1, "the ended lease is gone, the held one kept");
    two.release().await.unwrap();
    assert_eq!(kept(&sup), 0);
    // A job alone, then a job while an explicit lease is held (and the lease after it).
    sup.run(JobSpec::new("alone").unwrap(), |_ctx| async {
        Ok::<_, Infallible>(())
    })
    .await
    .unwrap();
    assert_eq!(kept(&sup), 0, "a finished job is not kept");
    let mut held = sup.acquire().await.unwrap();
    sup.run(JobSpec::new("beside").unwrap(), |_ctx| async {
        Ok::<_, Infallible>(())
    })
    .await
    .unwrap();
    assert_eq!(kept(&sup), 1, "only the explicit lease is left");
    held.release().await.unwrap();
    assert_eq!(kept(&sup), 0);
    // Callers that waited for a slot: served, then ended.
    let mut a = sup.acquire().await.unwrap();
    let mut b = sup.acquire().await.unwrap();
    let waiting = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.acquire().await })
    };
    while sup.stats().waiting == 0 {
        tokio::task::yield_now().await;
    }
    a.release().await.unwrap();
    let mut c = waiting.await.unwrap().unwrap();
    b.release().await.unwrap();
    c.release().await.unwrap();
    assert_eq!(kept(&sup), 0);
    sup.shutdown().await.unwrap();
}
