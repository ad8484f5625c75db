//! Supervisors on `EtcdBroker` under the failures a shared pool meets: several processes,
//! an etcd killed and restarted, a holder stopped past its TTL, a network that stops answering,
//! and auth.
//!
//! The occupancy checks use an independent record (files created after a grant and removed
//! before the release, see `etcd_support::OccupancyRecord`), never the supervisors' counters.
//! Child processes are this test binary run again with `LEASEHOLD_ETCD_CHILD` set, entering
//! through the `etcd_client_process` test.

mod etcd_support;

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use etcd_support::{
    ChildGuard, Etcd, OccupancyRecord, Proxy, etcd_binary, lines_of, next_line_with,
};
use leasehold::{AcquireRequest, FencingGuard, JobSpec, SlotBroker, Supervisor, codes};
use leasehold_etcd::EtcdBroker;
use parking_lot::Mutex;

const CHILD_ENV: &str = "LEASEHOLD_ETCD_CHILD";

use etcd_support::test_config as config;

async fn slot_keys(endpoint: &str, pool: &str) -> Vec<(String, i64)> {
    let mut c = Client::connect([endpoint], None).await.unwrap();
    etcd_support::slot_keys(&mut c, pool).await
}

/// Waits (bounded) until no slot key is left in the pool: orphans expire within the TTL.
async fn wait_pool_empty(endpoint: &str, pool: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = slot_keys(endpoint, pool).await;
        if left.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "slots still held after {within:?}: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The child process.

/// One client process: a supervisor on an `EtcdBroker` running `jobs` jobs, each recorded in
/// the occupancy record while it holds its slot. Returns (ok, failure codes).
async fn share_pool(
    endpoint: &str,
    pool: &str,
    capacity: u32,
    jobs: usize,
    name: &str,
    record: &Path,
) -> (usize, Vec<String>) {
    let broker = EtcdBroker::connect(config(endpoint, pool, capacity))
        .await
        .expect("connect");
    let sup = Supervisor::builder().broker(broker).start().await.unwrap();
    let record = Arc::new(OccupancyRecord::at(record));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..jobs {
        let sup = sup.clone();
        let record = Arc::clone(&record);
        let who = format!("{name}-{i}");
        set.spawn(async move {
            sup.run(JobSpec::new(who.clone()).unwrap(), move |_ctx| async move {
                let holders = record.enter(&who);
                // Simulated work, long enough for jobs of both processes to overlap.
                tokio::time::sleep(Duration::from_millis(5 + (i as u64 * 7) % 20)).await;
                record.leave(&who);
                if holders as u32 > capacity {
                    return Err(format!("{holders} holders at once"));
                }
                Ok(())
            })
            .await
        });
    }
    let mut ok = 0;
    let mut failed = Vec::new();
    while let Some(done) = set.join_next().await {
        match done.unwrap() {
            Ok(()) => ok += 1,
            Err(e) => failed.push(format!("{}: {e}", e.code())),
        }
    }
    sup.shutdown().await.unwrap();
    (ok, failed)
}

/// Holds one slot in a job that waits for cancellation; prints GRANTED, then the result code.
async fn hold_slot(endpoint: &str, pool: &str) {
    let broker = EtcdBroker::connect(config(endpoint, pool, 1))
        .await
        .expect("connect");
    let sup = Supervisor::builder().broker(broker).start().await.unwrap();
    let result = sup
        .run(JobSpec::new("holder").unwrap(), |ctx| async move {
            let t = ctx.token();
            println!("GRANTED {} {}", t.slot_id(), t.lease_id());
            std::io::stdout().flush().unwrap();
            ctx.cancelled().await;
            Ok::<_, String>(())
        })
        .await;
    match result {
        Ok(()) => println!("RESULT OK"),
        Err(e) => println!("RESULT {} {e}", e.code()),
    }
    std::io::stdout().flush().unwrap();
    sup.shutdown().await.unwrap();
}

/// The entry point of child processes; run directly, it checks one process on its own etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_client_process() {
    match std::env::var(CHILD_ENV).as_deref() {
        Ok("share") => {
            let var = |k: &str| std::env::var(k).unwrap();
            let (ok, failed) = share_pool(
                &var("LH_ENDPOINT"),
                &var("LH_POOL"),
                var("LH_CAPACITY").parse().unwrap(),
                var("LH_JOBS").parse().unwrap(),
                &var("LH_NAME"),
                Path::new(&var("LH_RECORD")),
            )
            .await;
            println!("DONE ok={ok} failed={failed:?}");
            std::io::stdout().flush().unwrap();
            std::process::exit(if failed.is_empty() { 0 } else { 1 });
        }
        Ok("hold") => {
            let var = |k: &str| std::env::var(k).unwrap();
            hold_slot(&var("LH_ENDPOINT"), &var("LH_POOL")).await;
            std::process::exit(0);
        }
        Ok(other) => panic!("unknown child mode {other}"),
        Err(_) => {
            // Not a child: the same routine in this process, on its own etcd.
            let Some(bin) = etcd_binary("etcd_client_process") else {
                return;
            };
            let etcd = Etcd::start(&bin);
            let dir = tempfile::tempdir().unwrap();
            let (ok, failed) = share_pool(&etcd.endpoint(), "solo", 2, 8, "solo", dir.path()).await;
            assert_eq!((ok, failed.len()), (8, 0), "{failed:?}");
            assert!(OccupancyRecord::max_overlap(dir.path()) <= 2);
            assert_eq!(OccupancyRecord::holders_now(dir.path()), 0);
            assert!(slot_keys(&etcd.endpoint(), "solo").await.is_empty());
        }
    }
}

fn spawn_child(mode: &str, vars: &[(&str, String)]) -> ChildGuard {
    etcd_support::spawn_test_child("etcd_client_process", CHILD_ENV, mode, vars)
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_three_slots_for_sixty_jobs_never_holding_more_than_three() {
    let Some(bin) = etcd_binary("two_processes_share_three_slots") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let dir = tempfile::tempdir().unwrap();
    let mut children: Vec<_> = ["A", "B"]
        .iter()
        .map(|name| {
            spawn_child(
                "share",
                &[
                    ("LH_ENDPOINT", etcd.endpoint()),
                    ("LH_POOL", "shared".into()),
                    ("LH_CAPACITY", "3".into()),
                    ("LH_JOBS", "30".into()),
                    ("LH_NAME", (*name).into()),
                    ("LH_RECORD", dir.path().display().to_string()),
                ],
            )
        })
        .collect();
    let outputs: Vec<_> = children.iter_mut().map(|c| lines_of(c)).collect();
    for (child, out) in children.iter_mut().zip(&outputs) {
        let done = next_line_with(out, "DONE");
        let status = child.wait().unwrap();
        assert!(status.success(), "child failed: {done}");
        assert_eq!(done, "DONE ok=30 failed=[]");
    }
    let max = OccupancyRecord::max_overlap(dir.path());
    let seen = OccupancyRecord::max_seen(dir.path());
    assert!(max <= 3, "{max} jobs held a slot at once");
    assert!(seen <= 3, "a job saw {seen} holders");
    assert!(max >= 2, "the two processes did overlap (max {max})");
    assert_eq!(OccupancyRecord::holders_now(dir.path()), 0);
    assert!(
        slot_keys(&etcd.endpoint(), "shared").await.is_empty(),
        "every slot free at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_stopped_past_the_ttl_loses_its_slot_and_its_fencing_token_is_refused() {
    let Some(bin) = etcd_binary("a_holder_stopped_past_the_ttl") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut child = spawn_child(
        "hold",
        &[("LH_ENDPOINT", etcd.endpoint()), ("LH_POOL", "stop".into())],
    );
    let out = lines_of(&mut child);
    let granted = next_line_with(&out, "GRANTED");
    let stale: u64 = granted.split(' ').nth(2).unwrap().parse().unwrap();
    // The protected resource has accepted the holder's writes so far.
    let resource = FencingGuard::new();
    resource.check_id(stale).unwrap();

    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();

    // Another client waits on its watch and gets the slot once the stopped holder's TTL ran out.
    let other = EtcdBroker::connect(config(&etcd.endpoint(), "stop", 1))
        .await
        .unwrap();
    let token = tokio::time::timeout(
        Duration::from_secs(10),
        other.acquire(AcquireRequest::new(1, None)),
    )
    .await
    .expect("the slot is handed on after the ttl")
    .unwrap();
    assert!(token.lease_id() > stale);
    resource.check(token).unwrap();

    // The stale holder wakes up: its token is refused, and its job ends as LEASE_LOST.
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
    let refused = resource.check_id(stale).unwrap_err();
    assert_eq!(refused.code(), codes::LEASE_FENCED);
    let result = next_line_with(&out, "RESULT");
    assert!(
        result.starts_with(&format!("RESULT {}", codes::LEASE_LOST)),
        "{result}"
    );
    assert!(child.wait().unwrap().success());
    other.release(token).await.unwrap();
    wait_pool_empty(&etcd.endpoint(), "stop", Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cut_off_from_etcd_ends_lease_lost_without_retrying_its_release_and_the_orphan_is_counted()
 {
    let Some(bin) = etcd_binary("a_job_cut_off_from_etcd_ends_lease_lost") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Proxy::start(etcd.client_port());
    // Releases retry for 3 s (`retry_for`), longer than a lost lease may take to end its job.
    let broker = EtcdBroker::connect(config(&proxy.endpoint(), "cut", 1))
        .await
        .unwrap();
    let sup = Supervisor::builder()
        .broker(broker)
        .cleanup_timeout(Duration::from_secs(5))
        .start()
        .await
        .unwrap();
    let (granted_tx, granted_rx) = tokio::sync::oneshot::channel();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("cut-off").unwrap(), |ctx| async move {
                let _ = granted_tx.send(ctx.token());
                ctx.cancelled().await;
                Ok::<_, String>(())
            })
            .await
        })
    };
    let token = granted_rx.await.unwrap();
    let cut = tokio::time::Instant::now();
    proxy.blackhole();

    let err = tokio::time::timeout(Duration::from_secs(10), job)
        .await
        .expect("the job is cancelled before its lease can lapse")
        .unwrap()
        .unwrap_err();
    let ended_after = cut.elapsed();
    // Lost means lost: the job's result is the loss, and the release of a token the broker
    // already reported lost is not retried against an etcd it cannot reach.
    assert_eq!(err.code(), codes::LEASE_LOST, "{err} after {ended_after:?}");
    assert!(err.cleanup_error().is_none(), "{err}");
    let body = err.body_error().expect("the body part says why");
    assert!(
        body.lease_lost().unwrap().contains("ETCD_LEASE_LOST"),
        "{err}"
    );
    // The loss is seen a quarter of the TTL (0.5 s) before the 2 s TTL could lapse; the
    // release's 3 s of retries would come on top.
    assert!(
        ended_after < Duration::from_secs(3),
        "the job ended {ended_after:?} after the cut"
    );

    // Meanwhile the TTL hands the slot on.
    let other = EtcdBroker::connect(config(&etcd.endpoint(), "cut", 1))
        .await
        .unwrap();
    let next = tokio::time::timeout(
        Duration::from_secs(10),
        other.acquire(AcquireRequest::new(1, None)),
    )
    .await
    .expect("slot returns within the ttl")
    .unwrap();
    assert!(next.lease_id() > token.lease_id());

    // Reachable again: the supervisor counts the orphan that expired.
    proxy.heal();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sup.stats().orphan_expired_total == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "orphan never counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = sup.stats();
    assert_eq!(stats.orphan_expired_total, 1);
    assert_eq!(stats.active, 0);
    other.release(next).await.unwrap();
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_restarted_mid_run_ends_jobs_clearly_and_never_double_holds_a_slot() {
    let Some(bin) = etcd_binary("etcd_killed_and_restarted_mid_run") else {
        return;
    };
    let mut etcd = Etcd::start(&bin);
    let endpoint = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let record = Arc::new(OccupancyRecord::at(dir.path()));
    // Per slot: who holds it now (checked at every enter).
    let by_slot: Arc<Mutex<HashMap<u32, String>>> = Arc::default();
    let mut sups = Vec::new();
    for _ in 0..2 {
        let broker = EtcdBroker::connect(config(&endpoint, "crash", 2))
            .await
            .unwrap();
        sups.push(
            Supervisor::builder()
                .broker(broker)
                .cleanup_timeout(Duration::from_secs(2))
                .start()
                .await
                .unwrap(),
        );
    }
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let run_wave = |wave: usize, jobs: usize| {
        let mut set = tokio::task::JoinSet::new();
        for i in 0..jobs {
            let sup = sups[i % 2].clone();
            let record = Arc::clone(&record);
            let by_slot = Arc::clone(&by_slot);
            let started = Arc::clone(&started);
            let who = format!("w{wave}-{i}");
            set.spawn(async move {
                sup.run(JobSpec::new(who.clone()).unwrap(), move |ctx| async move {
                    let holders = record.enter(&who);
                    if let Some(prev) = by_slot.lock().insert(ctx.slot_id(), who.clone()) {
                        panic!("slot {} held by {prev} and {who} at once", ctx.slot_id());
                    }
                    started.add_permits(1);
                    tokio::select! {
                        () = ctx.cancelled() => {}
                        () = tokio::time::sleep(Duration::from_millis(150)) => {}
                    }
                    by_slot.lock().remove(&ctx.slot_id());
                    record.leave(&who);
                    assert!(holders <= 2, "{holders} holders at once");
                    Ok::<_, String>(())
                })
                .await
            });
        }
        set
    };
    let mut wave = run_wave(0, 24);
    // Kill etcd once a few jobs have started, restart it on the same data dir.
    let _ = started.acquire_many(3).await.unwrap();
    etcd.kill9();
    etcd.restart();
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    while let Some(done) = wave.join_next().await {
        let code = match done.expect("no job panicked (no double hold)") {
            Ok(()) => "OK".to_owned(),
            Err(e) => {
                assert!(!e.to_string().is_empty());
                e.code().to_owned()
            }
        };
        *outcomes.entry(code).or_default() += 1;
    }
    let allowed = [
        "OK",
        codes::LEASE_LOST,
        codes::LEASE_ACQUIRE_FAILED,
        codes::LEASE_CLEANUP_FAILED,
        codes::LEASE_CLEANUP_TIMEOUT,
        codes::LEASE_BODY_AND_CLEANUP_FAILED,
    ];
    assert!(
        outcomes.keys().all(|k| allowed.contains(&k.as_str())),
        "unexpected outcomes {outcomes:?}"
    );
    // After the restart the pool carries on.
    let mut after = run_wave(1, 6);
    while let Some(done) = after.join_next().await {
        done.unwrap().expect("jobs after the restart succeed");
    }
    assert!(OccupancyRecord::max_overlap(dir.path()) <= 2);
    assert_eq!(OccupancyRecord::holders_now(dir.path()), 0);
    for sup in sups {
        let stats = sup.stats();
        assert_eq!(stats.active, 0);
        sup.shutdown().await.unwrap();
    }
    wait_pool_empty(&endpoint, "crash", Duration::from_secs(10)).await;
    eprintln!("outcomes across the etcd restart: {outcomes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_password_auth_is_used_and_a_wrong_password_is_refused_without_showing_it() {
    let Some(bin) = etcd_binary("user_password_auth") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut root = Client::connect([etcd.endpoint()], None).await.unwrap();
    root.user_add("root", "r00t-pw", None).await.unwrap();
    root.user_grant_role("root", "root").await.unwrap();
    root.auth_enable().await.unwrap();

    let broker = EtcdBroker::connect(config(&etcd.endpoint(), "auth", 1).user("root", "r00t-pw"))
        .await
        .unwrap();
    let t = broker.acquire(AcquireRequest::new(1, None)).await.unwrap();
    broker.release(t).await.unwrap();

    let err = EtcdBroker::connect(config(&etcd.endpoint(), "auth", 1).user("root", "wrong-pw"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "ETCD_AUTH_FAILED", "{err}");
    assert!(!format!("{err} {err:?}").contains("wrong-pw"));
    let err = EtcdBroker::connect(config(&etcd.endpoint(), "auth", 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "ETCD_AUTH_FAILED", "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_freed_by_a_lost_lease_is_not_handed_out_while_its_old_job_winds_down() {
    let Some(bin) = etcd_binary("a_slot_freed_by_a_lost_lease") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Proxy::start(etcd.client_port());
    let broker = EtcdBroker::connect(
        config(&proxy.endpoint(), "wind", 2).retry_for(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    let sup = Supervisor::builder()
        .broker(broker)
        .cleanup_timeout(Duration::from_secs(2))
        .cancel_grace(Duration::from_secs(30))
        .start()
        .await
        .unwrap();
    let (granted_tx, granted_rx) = tokio::sync::oneshot::channel();
    let (cancelled_tx, cancelled_rx) = tokio::sync::oneshot::channel();
    let finish = Arc::new(tokio::sync::Notify::new());
    let old = {
        let sup = sup.clone();
        let finish = Arc::clone(&finish);
        tokio::spawn(async move {
            sup.run(JobSpec::new("old").unwrap(), move |ctx| async move {
                let _ = granted_tx.send(ctx.slot_id());
                ctx.cancelled().await;
                let _ = cancelled_tx.send(());
                // Winds down slowly: the slot is still this process's until it has.
                finish.notified().await;
                Ok::<_, String>(())
            })
            .await
        })
    };
    let old_slot = granted_rx.await.unwrap();
    proxy.blackhole();
    tokio::time::timeout(Duration::from_secs(10), cancelled_rx)
        .await
        .expect("the job is told its lease is lost")
        .unwrap();
    // etcd lets the lease lapse, so it calls both slots free; then this process reaches etcd
    // again while the old job still runs.
    wait_pool_empty(&etcd.endpoint(), "wind", Duration::from_secs(10)).await;
    proxy.heal();

    // A new job of the same supervisor gets the other slot, and is not refused as a
    // duplicate of the slot its old job still occupies here.
    let served = tokio::time::timeout(
        Duration::from_secs(10),
        sup.run(JobSpec::new("next").unwrap(), |ctx| async move {
            Ok::<_, String>(ctx.slot_id())
        }),
    )
    .await
    .expect("the next job is served")
    .expect("not refused as a duplicate slot");
    assert_ne!(served, old_slot);

    finish.notify_one();
    let old = old.await.unwrap().unwrap_err();
    assert_eq!(old.body_error().unwrap().code(), codes::LEASE_LOST, "{old}");
    // And once the old job has ended, its slot serves again.
    let again: Vec<u32> = futures_join(&sup).await;
    assert!(again.contains(&old_slot), "{again:?}");
    let stats = sup.stats();
    assert_eq!(stats.active, 0);
    sup.shutdown().await.unwrap();
    wait_pool_empty(&etcd.endpoint(), "wind", Duration::from_secs(5)).await;
}

/// Runs two jobs at once and returns the slots they got.
async fn futures_join(sup: &Supervisor) -> Vec<u32> {
    let gate = Arc::new(tokio::sync::Barrier::new(2));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..2 {
        let sup = sup.clone();
        let gate = Arc::clone(&gate);
        set.spawn(async move {
            sup.run(
                JobSpec::new(format!("pair-{i}")).unwrap(),
                move |ctx| async move {
                    gate.wait().await; // both slots held at once
                    Ok::<_, String>(ctx.slot_id())
                },
            )
            .await
            .unwrap()
        });
    }
    let mut slots = Vec::new();
    while let Some(s) = set.join_next().await {
        slots.push(s.unwrap());
    }
    slots
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_lease_says_when_it_is_lost() {
    let Some(bin) = etcd_binary("an_explicit_lease_says_when_it_is_lost") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Proxy::start(etcd.client_port());
    let broker = EtcdBroker::connect(
        config(&proxy.endpoint(), "explicit", 1).retry_for(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    let sup = Supervisor::builder()
        .broker(broker)
        .cleanup_timeout(Duration::from_secs(2))
        .start()
        .await
        .unwrap();
    let mut lease = sup.acquire().await.unwrap();
    assert!(!lease.is_lost());
    proxy.blackhole();
    tokio::time::timeout(Duration::from_secs(10), lease.lost())
        .await
        .expect("lost() resolves before the lease could lapse");
    assert!(lease.is_lost());
    proxy.heal();
    // Released all the same; the lapsed lease's revoke answers "not found", which is fine.
    lease.release().await.unwrap();
    sup.shutdown().await.unwrap();
}
