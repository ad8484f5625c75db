//! `EtcdBroker` on a 3-member etcd cluster on loopback (throwaway data dirs), under member
//! failures: a follower or the leader killed while eight client processes share the pool, the
//! quorum lost and regained, a waiter whose session expires, a capacity mismatch, FIFO order
//! across a leader election, and a dead member skipped.
//!
//! Every run is checked against an independent ledger the jobs keep (`etcd_support::Ledger`):
//! per slot, hold intervals never overlap and tokens increase. Child processes are this test
//! binary run again with `LEASEHOLD_FAILOVER_CHILD` set, entering through
//! `failover_client_process`. The tests take one cluster at a time (they are heavy on two
//! cores).

mod etcd_support;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use etcd_support::{
    ChildGuard, Cluster, Ledger, Proxy, etcd_binary, lines_of, next_line_with, now_ns,
    spawn_test_child, wait_queued,
};
use leasehold::{AcquireRequest, JobSpec, SlotBroker, SlotToken, Supervisor, codes};
use leasehold_etcd::{EtcdBroker, EtcdConfig};
use tokio::time::Instant;

const CHILD_ENV: &str = "LEASEHOLD_FAILOVER_CHILD";
/// The session TTL of every broker here: the shortest etcd allows leasehold (2 s).
const TTL: Duration = Duration::from_secs(2);

/// One cluster at a time.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A broker on every member, with a 2 s TTL; a step retries for 10 s (an election takes one
/// or two).
fn config(endpoints: &[String], pool: &str, capacity: u32) -> EtcdConfig {
    EtcdConfig::new(endpoints, pool, capacity)
        .ttl(TTL)
        .rpc_timeout(Duration::from_millis(500))
        .retry_for(Duration::from_secs(10))
}

async fn client(endpoints: &[String]) -> Client {
    Client::connect(endpoints, None).await.unwrap()
}

/// Keys under `{pool}/{section}` (slot/, queue/), read straight from etcd.
async fn keys(c: &mut Client, pool: &str, section: &str) -> Vec<String> {
    c.get(
        format!("leasehold/{pool}/{section}"),
        Some(GetOptions::new().with_prefix().with_keys_only()),
    )
    .await
    .unwrap()
    .kvs()
    .iter()
    .map(|kv| kv.key_str().unwrap().to_owned())
    .collect()
}

/// Polls `check` until it says true, or panics with `what` after `within`.
async fn wait_until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A job's hold: 1–5 ms, spread by its number.
fn hold_for(i: usize) -> Duration {
    Duration::from_millis(1 + (i as u64 * 7) % 5)
}

// ---------------------------------------------------------------------------------------------
// The child process.

/// One client process: a supervisor on an `EtcdBroker` over every member, running `jobs` jobs
/// of 1–5 ms at once, each recorded in the ledger. Prints `DONE` with its outcomes by code.
async fn run_jobs(
    endpoints: &[String],
    pool: &str,
    capacity: u32,
    jobs: usize,
    name: &str,
    ledger: &Path,
) {
    let broker = EtcdBroker::connect(config(endpoints, pool, capacity))
        .await
        .expect("connect");
    let sup = Supervisor::builder()
        .broker(broker)
        .cleanup_timeout(Duration::from_secs(10))
        .start()
        .await
        .unwrap();
    let ledger = Arc::new(Ledger::at(ledger));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..jobs {
        let (sup, ledger) = (sup.clone(), Arc::clone(&ledger));
        let who = format!("{name}-{i}");
        set.spawn(async move {
            sup.run(JobSpec::new(who.clone()).unwrap(), move |ctx| async move {
                let start = now_ns();
                tokio::select! {
                    () = ctx.cancelled() => {}
                    () = tokio::time::sleep(hold_for(i)) => {}
                }
                ledger.record(ctx.slot_id(), ctx.token().lease_id(), start, now_ns(), &who);
                Ok::<_, String>(())
            })
            .await
        });
    }
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(done) = set.join_next().await {
        let code = match done.unwrap() {
            Ok(()) => "OK".to_owned(),
            Err(e) => e.code().to_owned(),
        };
        *outcomes.entry(code).or_default() += 1;
    }
    sup.shutdown().await.unwrap();
    let line: Vec<String> = outcomes.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("DONE {}", line.join(","));
    std::io::stdout().flush().unwrap();
}

/// The entry point of child processes; run directly (no child mode), it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_client_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    assert_eq!(mode, "jobs", "unknown child mode");
    let var = |k: &str| std::env::var(k).unwrap();
    let endpoints: Vec<String> = var("LH_ENDPOINTS").split(',').map(str::to_owned).collect();
    run_jobs(
        &endpoints,
        &var("LH_POOL"),
        var("LH_CAPACITY").parse().unwrap(),
        var("LH_JOBS").parse().unwrap(),
        &var("LH_NAME"),
        Path::new(&var("LH_LEDGER")),
    )
    .await;
    std::process::exit(0);
}

/// Starts `processes` clients of `jobs` jobs each on `pool`.
fn clients(
    cluster: &Cluster,
    pool: &str,
    capacity: u32,
    processes: usize,
    jobs: usize,
    ledger: &Path,
) -> Vec<ChildGuard> {
    (0..processes)
        .map(|p| {
            spawn_test_child(
                "failover_client_process",
                CHILD_ENV,
                "jobs",
                &[
                    ("LH_ENDPOINTS", cluster.endpoints().join(",")),
                    ("LH_POOL", pool.to_owned()),
                    ("LH_CAPACITY", capacity.to_string()),
                    ("LH_JOBS", jobs.to_string()),
                    ("LH_NAME", format!("p{p}")),
                    ("LH_LEDGER", ledger.display().to_string()),
                ],
            )
        })
        .collect()
}

/// Waits for every client's `DONE` line and exit; sums their outcomes by code.
fn outcomes(children: &mut [ChildGuard]) -> BTreeMap<String, usize> {
    let mut total = BTreeMap::new();
    for child in children.iter_mut() {
        let out = lines_of(child);
        let done = next_line_with(&out, "DONE");
        assert!(child.wait().unwrap().success(), "client failed: {done}");
        for pair in done
            .trim_start_matches("DONE ")
            .split(',')
            .filter(|p| !p.is_empty())
        {
            let (code, n) = pair.split_once('=').unwrap();
            *total.entry(code.to_owned()).or_default() += n.parse::<usize>().unwrap();
        }
    }
    total
}

/// Eight processes share 4 slots for 40 jobs each; `victim` picks the member killed once a
/// third of the jobs are done. Returns the outcomes, checked against the ledger.
async fn kill_mid_run(
    pool: &str,
    victim: impl FnOnce(&mut Cluster) -> usize,
) -> BTreeMap<String, usize> {
    let Some(bin) = etcd_binary(pool) else {
        return BTreeMap::new();
    };
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = Cluster::start(&bin, 3);
    let dir = tempfile::tempdir().unwrap();
    let (processes, jobs) = (8, 40);
    let mut children = clients(&cluster, pool, 4, processes, jobs, dir.path());
    wait_until(Duration::from_secs(120), "a third of the jobs done", || {
        let n = Ledger::count(dir.path());
        async move { n >= processes * jobs / 3 }
    })
    .await;
    let killed = victim(&mut cluster);
    cluster.kill9(killed);
    let outcomes = tokio::task::spawn_blocking(move || outcomes(&mut children))
        .await
        .unwrap();
    assert_eq!(
        outcomes.values().sum::<usize>(),
        processes * jobs,
        "{outcomes:?}"
    );
    let held = Ledger::check(dir.path()).unwrap_or_else(|e| panic!("ledger: {e}"));
    assert!(
        held >= outcomes.get("OK").copied().unwrap_or(0),
        "every job that succeeded held its slot: {held} holds, {outcomes:?}"
    );
    let live: Vec<String> = (0..3)
        .filter(|i| *i != killed)
        .map(|i| cluster.endpoint(i))
        .collect();
    let c = client(&live).await;
    wait_until(
        Duration::from_secs(10),
        "every slot and place given back",
        || {
            let mut c = c.clone();
            let pool = pool.to_owned();
            async move {
                keys(&mut c, &pool, "slot/").await.is_empty()
                    && keys(&mut c, &pool, "queue/").await.is_empty()
            }
        },
    )
    .await;
    eprintln!("{pool}: member {killed} killed; outcomes {outcomes:?}");
    outcomes
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_killed_mid_run_costs_no_job_and_never_double_holds_a_slot() {
    let outcomes = kill_mid_run("follower", |cluster| {
        let leader = cluster.wait_leader(Duration::from_secs(10));
        (leader + 1) % 3
    })
    .await;
    if outcomes.is_empty() {
        return; // skipped: no etcd
    }
    assert_eq!(
        outcomes.keys().collect::<Vec<_>>(),
        vec!["OK"],
        "{outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_mid_run_fails_no_waiter_and_never_double_holds_a_slot() {
    let outcomes = kill_mid_run("leader", |cluster| {
        cluster.wait_leader(Duration::from_secs(10))
    })
    .await;
    if outcomes.is_empty() {
        return;
    }
    // A job holding its slot through the election may be told its lease could lapse; no job
    // fails while it waits.
    assert!(
        outcomes.keys().all(|k| k == "OK" || k == codes::LEASE_LOST),
        "{outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_quorum_grants_nothing_tells_holders_within_the_ttl_and_recovers_with_one_holder_per_slot()
 {
    let Some(bin) = etcd_binary("losing_the_quorum") else {
        return;
    };
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = Cluster::start(&bin, 3);
    let endpoints = cluster.endpoints();
    let dir = tempfile::tempdir().unwrap();
    let ledger = Arc::new(Ledger::at(dir.path()));
    let mut sups = Vec::new();
    for _ in 0..2 {
        let broker = EtcdBroker::connect(config(&endpoints, "quorum", 2))
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
    // Two holders (one per supervisor) that hold until told otherwise, and two waiters.
    let (told_tx, mut told) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let granted_later = Arc::new(AtomicUsize::new(0));
    let mut jobs = tokio::task::JoinSet::new();
    for i in 0..4usize {
        let (sup, ledger, told_tx) = (sups[i % 2].clone(), Arc::clone(&ledger), told_tx.clone());
        let (started, granted_later) = (Arc::clone(&started), Arc::clone(&granted_later));
        if i == 2 {
            // The waiters come once both holders hold.
            let _ = started.acquire_many(2).await.unwrap();
        }
        jobs.spawn(async move {
            sup.run(
                JobSpec::new(format!("q{i}")).unwrap(),
                move |ctx| async move {
                    let start = now_ns();
                    if i < 2 {
                        started.add_permits(1);
                        ctx.cancelled().await;
                        let _ = told_tx.send(Instant::now());
                    } else {
                        granted_later.fetch_add(1, Ordering::SeqCst);
                    }
                    ledger.record(
                        ctx.slot_id(),
                        ctx.token().lease_id(),
                        start,
                        now_ns(),
                        &format!("q{i}"),
                    );
                    Ok::<_, String>(())
                },
            )
            .await
        });
    }
    let mut c = client(&endpoints).await;
    wait_until(Duration::from_secs(10), "both waiters queued", || {
        let mut c = c.clone();
        async move { keys(&mut c, "quorum", "queue/").await.len() == 2 }
    })
    .await;

    // Two of three members die: no quorum.
    let leader = cluster.wait_leader(Duration::from_secs(10));
    let (a, b) = (leader, (leader + 1) % 3);
    let lost_at = Instant::now();
    cluster.kill9(a);
    cluster.kill9(b);
    for _ in 0..2 {
        let at = tokio::time::timeout(TTL * 5, told.recv())
            .await
            .expect("holders are told their lease is lost")
            .unwrap();
        assert!(
            at - lost_at <= TTL,
            "a holder learned of the loss {:?} after the quorum went (ttl {TTL:?})",
            at - lost_at
        );
    }
    // Without a quorum nothing is granted: the waiters still wait.
    assert_eq!(
        granted_later.load(Ordering::SeqCst),
        0,
        "granted without a quorum"
    );

    // The quorum comes back: the waiters are served, one holder per slot.
    cluster.restart(a);
    cluster.restart(b);
    cluster.wait_healthy(Duration::from_secs(30));
    let mut results = BTreeMap::<String, usize>::new();
    while let Some(done) = jobs.join_next().await {
        let code = match done.unwrap() {
            Ok(()) => "OK".to_owned(),
            Err(e) => {
                let body = e.body_error().map(|b| b.code()).unwrap_or("-");
                format!("{}/{body}", e.code())
            }
        };
        *results.entry(code).or_default() += 1;
    }
    assert_eq!(
        results.get("OK"),
        Some(&2),
        "the waiters were served after recovery: {results:?}"
    );
    assert!(
        results
            .keys()
            .filter(|k| *k != "OK")
            .all(|k| k.ends_with(codes::LEASE_LOST)),
        "the holders end LEASE_LOST: {results:?}"
    );
    assert_eq!(
        Ledger::check(dir.path()).unwrap_or_else(|e| panic!("ledger: {e}")),
        4
    );
    for sup in sups {
        sup.shutdown().await.unwrap();
    }
    c = client(&cluster.endpoints()).await;
    wait_until(Duration::from_secs(15), "every slot given back", || {
        let mut c = c.clone();
        async move { keys(&mut c, "quorum", "slot/").await.is_empty() }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_session_expires_fails_with_etcd_session_expired_and_gets_no_slot() {
    let Some(bin) = etcd_binary("a_waiter_whose_session_expires") else {
        return;
    };
    let _one = ONE_CLUSTER.lock().await;
    let cluster = Cluster::start(&bin, 3);
    let endpoints = cluster.endpoints();
    let holder = EtcdBroker::connect(config(&endpoints, "expiry", 1))
        .await
        .unwrap();
    let held = holder.acquire(AcquireRequest::new(1, None)).await.unwrap();
    // The waiter reaches the cluster through one proxy, which then stops answering.
    let proxy = Proxy::start(cluster.client_port(0));
    let waiter = Arc::new(
        EtcdBroker::connect(config(&[proxy.endpoint()], "expiry", 1))
            .await
            .unwrap(),
    );
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(AcquireRequest::new(1, None)).await })
    };
    let mut c = client(&endpoints).await;
    wait_queued(&c, &waiter, &AcquireRequest::new(1, None)).await;
    let session = waiter.session_lease().unwrap();
    proxy.blackhole();
    // etcd expires the cut-off session one TTL later, and its place with it.
    wait_until(
        TTL * 5,
        "etcd expires the waiter's session and its place",
        || {
            let mut c = c.clone();
            async move {
                // -1: etcd no longer knows the lease (revoked by its expiry, keys deleted).
                c.lease_time_to_live(session, None).await.unwrap().ttl() == -1
                    && keys(&mut c, "expiry", "queue/").await.is_empty()
            }
        },
    )
    .await;
    proxy.heal();
    let err = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("the waiter learns it once etcd answers")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), Some("ETCD_SESSION_EXPIRED"), "{err}");
    // The slot goes back to the pool, not to the expired waiter.
    holder.release(held).await.unwrap();
    assert!(keys(&mut c, "expiry", "slot/").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_mismatch_is_refused_through_any_member() {
    let Some(bin) = etcd_binary("a_capacity_mismatch") else {
        return;
    };
    let _one = ONE_CLUSTER.lock().await;
    let cluster = Cluster::start(&bin, 3);
    let _first = EtcdBroker::connect(config(&[cluster.endpoint(0)], "mismatch", 2))
        .await
        .unwrap();
    for i in 0..3 {
        let err = EtcdBroker::connect(config(&[cluster.endpoint(i)], "mismatch", 3))
            .await
            .unwrap_err();
        assert_eq!(err.code(), "ETCD_CAPACITY_MISMATCH", "member {i}: {err}");
    }
    let err = EtcdBroker::connect(config(&cluster.endpoints(), "mismatch", 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "ETCD_CAPACITY_MISMATCH", "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_keep_their_fifo_places_through_a_leader_election() {
    let Some(bin) = etcd_binary("waiters_keep_their_fifo_places") else {
        return;
    };
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = Cluster::start(&bin, 3);
    let endpoints = cluster.endpoints();
    let holder = EtcdBroker::connect(config(&endpoints, "fifo", 1))
        .await
        .unwrap();
    let first = holder.acquire(AcquireRequest::new(1, None)).await.unwrap();
    // Six waiters, each its own broker (its own session), queued in a known order. Their calls
    // give up after 1 s, less than an election: a waiter whose watch stream was on the leader
    // looks again during the election, and must keep its place all the same.
    let mut c = client(&endpoints).await;
    let (granted_tx, mut granted) = tokio::sync::mpsc::unbounded_channel::<(usize, SlotToken)>();
    let mut waiters = Vec::new();
    for w in 1..=6usize {
        let broker = Arc::new(
            EtcdBroker::connect(config(&endpoints, "fifo", 1).retry_for(Duration::from_secs(1)))
                .await
                .unwrap(),
        );
        let request = AcquireRequest::new(1, None);
        let granted_tx = granted_tx.clone();
        waiters.push(tokio::spawn({
            let broker = Arc::clone(&broker);
            let request = request.clone();
            async move {
                let token = broker
                    .acquire(request)
                    .await
                    .expect("a waiter never fails here");
                granted_tx.send((w, token)).unwrap();
                broker.release(token).await.unwrap();
            }
        }));
        wait_queued(&c, &broker, &request).await;
    }
    // The leader dies with everyone queued; the holder's release goes through the election.
    let leader = cluster.wait_leader(Duration::from_secs(10));
    cluster.kill9(leader);
    holder.release(first).await.unwrap();
    let mut order = Vec::new();
    let mut last = first.lease_id();
    for _ in 1..=6 {
        let (w, token) = tokio::time::timeout(Duration::from_secs(30), granted.recv())
            .await
            .expect("every waiter is served")
            .unwrap();
        assert!(token.lease_id() > last, "tokens increase");
        last = token.lease_id();
        order.push(w);
    }
    assert_eq!(order, vec![1, 2, 3, 4, 5, 6], "FIFO across the election");
    for w in waiters {
        w.await.unwrap();
    }
    let live: Vec<String> = (0..3)
        .filter(|i| *i != leader)
        .map(|i| cluster.endpoint(i))
        .collect();
    c = client(&live).await;
    assert!(keys(&mut c, "fifo", "slot/").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_member_is_skipped_until_it_answers_again() {
    let Some(bin) = etcd_binary("a_dead_member_is_skipped") else {
        return;
    };
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = Cluster::start(&bin, 3);
    // One proxy per member, to count the connections the broker makes to each.
    let proxies: Vec<Proxy> = (0..3)
        .map(|i| Proxy::start(cluster.client_port(i)))
        .collect();
    let through: Vec<String> = proxies.iter().map(Proxy::endpoint).collect();
    let broker = EtcdBroker::connect(config(&through, "skip", 2))
        .await
        .unwrap();
    let cycle = |n: u64| {
        let broker = &broker;
        async move {
            for r in 0..n {
                let t = broker
                    .acquire(AcquireRequest::new(1000 * n + r, None))
                    .await
                    .unwrap();
                broker.release(t).await.unwrap();
            }
        }
    };
    cycle(5).await;
    cluster.kill9(0);
    // The broker notices (if it was using that member) and moves on.
    cycle(5).await;
    let before = proxies[0].connections_accepted();
    cycle(50).await;
    let dialled = proxies[0].connections_accepted() - before;
    assert!(
        dialled <= 6,
        "the dead member was dialled {dialled} times in 50 acquire+release cycles (probes only expected)"
    );
    // Back again, it serves once the others stop answering.
    cluster.restart(0);
    cluster.wait_healthy(Duration::from_secs(30));
    proxies[1].blackhole();
    proxies[2].blackhole();
    tokio::time::timeout(Duration::from_secs(20), cycle(3))
        .await
        .expect("the member that came back serves");
}
