//! Nothing strands a slot: each test puts a real etcd in a state the broker once left a slot
//! or a queue key stranded in (held by a live session that nobody uses), and checks that the
//! pool still serves: a watch etcd cancels (asked by the client, and on its own after a
//! compaction passed the slot watch of a stopped process), a create etcd refuses, a cleanup
//! that meets an outage longer than any bound, a queue place that still holds a key, a grant of a slot index whose earlier token here
//! is not released, an acquire that reuses the request id of a release still settling (or
//! still in flight), a key among the slot keys that is not a slot key, and a waiter whose place
//! is gone while etcd does not answer whether its session lives (the session is kept, and
//! revoked at close).
//!
//! Needs an etcd binary (`cargo test -p leasehold-etcd`); without the binary each test says
//! SKIPPED, and with `LEASEHOLD_REQUIRE_ETCD=1` it fails instead.

mod etcd_support;

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    AlarmAction, AlarmOptions, AlarmType, Client, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp,
};
use etcd_support::{
    Etcd, Proxy, bench_data_base, connect_pool as connect, etcd_binary, http_get, keep, lines_of,
    slot_keys, spawn_test_child_with_stdin, tell, test_config as config, wait_queued, wait_until,
};
use leasehold::{AcquireRequest, BrokerErrorKind, SlotBroker, SlotToken};
use leasehold_etcd::EtcdBroker;

async fn client(etcd: &Etcd) -> Client {
    Client::connect([etcd.endpoint()], None).await.unwrap()
}

fn request(id: u64) -> AcquireRequest {
    AcquireRequest::new(id, Some("job"))
}

async fn exists(c: &Client, key: &str) -> bool {
    let mut c = c.clone();
    !c.get(key, None).await.unwrap().kvs().is_empty()
}

async fn queue_keys(c: &Client, pool: &str) -> Vec<String> {
    let mut c = c.clone();
    c.get(
        format!("leasehold/{pool}/queue/"),
        Some(GetOptions::new().with_prefix().with_keys_only()),
    )
    .await
    .unwrap()
    .kvs()
    .iter()
    .map(|kv| kv.key_str().unwrap().to_owned())
    .collect()
}

fn acquire_in_background(
    broker: &Arc<EtcdBroker>,
    id: u64,
) -> tokio::task::JoinHandle<Result<SlotToken, leasehold::BrokerError>> {
    let broker = Arc::clone(broker);
    tokio::spawn(async move { broker.acquire(request(id)).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_etcd_cancels_is_set_up_again_and_the_waiter_still_hears_its_grant() {
    let Some(bin) = etcd_binary("a_watch_that_etcd_cancels") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let c = client(&etcd).await;
    let holder = connect(&etcd, "cancelled", 1).await;
    let waiter = connect(&etcd, "cancelled", 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);
    let waiting = acquire_in_background(&waiter, 2);
    // The waiter's marker and slot watches are in place.
    wait_queued(&c, &waiter, &request(2)).await;
    wait_until(
        Duration::from_secs(10),
        "the waiter watches its marker",
        || {
            let n = waiter.watch_count();
            async move { n >= 2 }
        },
    )
    .await;

    // etcd cancels every watch of the waiter's stream (as it does to a watcher that a
    // compaction passed), and has said so.
    let cancelled = waiter.cancel_watches_on_server().await;
    assert!(
        cancelled >= 2,
        "the marker's and the slot keys' watches: {cancelled}"
    );
    wait_until(
        Duration::from_secs(10),
        "the watches are set up again",
        || {
            let n = waiter.watches_recreated();
            async move { n >= cancelled as u64 }
        },
    )
    .await;

    // The hand-off reaches the waiter through its watch set up again.
    renewal.abort();
    holder.release(held).await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter hears its grant after etcd cancelled its watches")
        .unwrap()
        .unwrap();
    assert!(token.lease_id() > held.lease_id());
    waiter.release(token).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// A child process: a broker whose process the test stops (SIGSTOP) and continues (SIGCONT).

const CHILD_ENV: &str = "LEASEHOLD_STRANDS_CHILD";

fn say(line: &str) {
    use std::io::Write;
    println!("{line}");
    std::io::stdout().flush().unwrap();
}

/// A waiter on a full pool of one slot, alone in the queue (so its broker watches its marker
/// and the slot keys, nothing else). Says `QUEUED` once both watches are in place, then answers
/// `stats` with its watch counters, says `GRANTED {token}` (or `FAILED {error}`) when its
/// acquire ends, and returns at `exit`.
async fn stalled_waiter(endpoint: &str, pool: &str, reuse_ids: bool) {
    // A TTL and call bound longer than the stop: the test stops the process, not its session.
    let broker = Arc::new(
        EtcdBroker::connect(
            config(endpoint, pool, 1)
                .ttl(Duration::from_secs(30))
                .rpc_timeout(Duration::from_secs(5)),
        )
        .await
        .unwrap(),
    );
    broker.reuse_watch_ids(reuse_ids);
    let mut waiting = acquire_in_background(&broker, 2);
    wait_until(Duration::from_secs(10), "the waiter queues", || {
        let queued = broker.queue_key_for(&request(2)).is_some() && broker.watch_count() >= 2;
        async move { queued }
    })
    .await;
    say("QUEUED");
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut token = None;
    let mut ended = false;
    loop {
        tokio::select! {
            line = lines.recv() => match line.as_deref().map(str::trim) {
                Some("stats") => say(&format!(
                    "STATS watches={} recreated={} cancels={} refused={}",
                    broker.watch_count(),
                    broker.watches_recreated(),
                    broker.watch_cancels_received(),
                    broker.watch_refusals(),
                )),
                Some("exit") | None => break,
                Some(other) => panic!("unknown command {other:?}"),
            },
            done = &mut waiting, if !ended => {
                ended = true;
                match done.unwrap() {
                    Ok(t) => {
                        say(&format!("GRANTED {}", t.lease_id()));
                        token = Some(t);
                    }
                    Err(e) => say(&format!("FAILED {e}")),
                }
            }
        }
    }
    if let Some(t) = token {
        broker.release(t).await.unwrap();
    }
    broker.close().await.unwrap();
}

/// The entry point of child processes; run directly (no child mode), it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_child_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap();
    match mode.as_str() {
        "stalled-waiter" => {
            let reuse = var("LH_REUSE_IDS") == "1";
            stalled_waiter(&var("LH_ENDPOINT"), &var("LH_POOL"), reuse).await;
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// The child's next line that starts with `prefix` within `within`; `None` if none came.
fn line_within(
    out: &std::sync::mpsc::Receiver<String>,
    prefix: &str,
    within: Duration,
) -> Option<String> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = deadline.checked_duration_since(std::time::Instant::now())?;
        let line = out.recv_timeout(left).ok()?;
        if let Some(at) = line.find(prefix) {
            return Some(line[at..].to_owned());
        }
    }
}

/// The child's watch counters.
#[derive(Debug, Clone, Copy)]
struct Stats {
    /// In place.
    watches: u64,
    /// Set up again after etcd ended them.
    recreated: u64,
    /// Cancels etcd sent for watches their owners held.
    cancels: u64,
    /// Creates etcd refused.
    refused: u64,
}

fn child_stats(
    child: &mut etcd_support::ChildGuard,
    out: &std::sync::mpsc::Receiver<String>,
) -> Stats {
    tell(child, "stats");
    let line = line_within(out, "STATS", Duration::from_secs(10)).expect("the child's stats");
    let field = |name: &str| -> u64 {
        line.split(' ')
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    Stats {
        watches: field("watches"),
        recreated: field("recreated"),
        cancels: field("cancels"),
        refused: field("refused"),
    }
}

/// The watchers etcd counts as slow (behind, or unable to take what it sends them).
fn slow_watchers(etcd: &Etcd) -> f64 {
    http_get(etcd.client_port(), "/metrics", Duration::from_secs(2))
        .map(|m| etcd_support::metric_sum(&m, "etcd_debugging_mvcc_slow_watcher_total"))
        .unwrap_or(0.0)
}

/// Deletions under `prefix` (keys that are not slot keys, which a broker ignores), each in its
/// own revision, until etcd counts a slow watcher: first sixteen deletions of sixteen 60 kB keys
/// each (15 MB of events, past the stopped client's flow-control window and socket buffers),
/// then small ones (past the stream's buffer of responses).
async fn flood_deletions(c: &mut Client, etcd: &Etcd, prefix: &str) {
    let pad = "x".repeat(60_000);
    for i in 0..16 {
        let puts: Vec<TxnOp> = (0..16)
            .map(|j| TxnOp::put(format!("{prefix}flood/{i:03}/{j:02}/{pad}"), "", None))
            .collect();
        c.txn(Txn::new().and_then(puts)).await.unwrap();
        c.delete(
            format!("{prefix}flood/{i:03}/"),
            Some(DeleteOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut i = 0;
    while slow_watchers(etcd) < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "etcd never counted the stopped watcher as slow"
        );
        for _ in 0..50 {
            let key = format!("{prefix}flood-{i}");
            c.put(key.as_str(), "", None).await.unwrap();
            c.delete(key, None).await.unwrap();
            i += 1;
        }
    }
    // Past the point where it went slow: those deletions are what a compaction takes away.
    for _ in 0..50 {
        let key = format!("{prefix}flood-{i}");
        c.put(key.as_str(), "", None).await.unwrap();
        c.delete(key, None).await.unwrap();
        i += 1;
    }
}

/// A waiter's process is stopped while deletions under `slot/` flood its slot watch (deletions
/// only), and the history it was not sent is compacted: etcd itself cancels that watch once the
/// process goes on. Then the only holder dies, and nobody else waits: only the slot watch can
/// tell the head its slot is free. Returns whether the head took it within 10 s, and the child's
/// watch counters before the holder died (its broker reuses a cancelled watch's id when
/// `reuse_ids`).
async fn stalled_slot_watch(bin: &std::path::Path, reuse_ids: bool) -> (bool, Stats) {
    let etcd = Etcd::start_in(bin, bench_data_base().as_deref());
    let mut c = client(&etcd).await;
    let pool = "compacted";
    let holder = connect(&etcd, pool, 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);

    // Another process waits at the head of the queue: its broker watches its marker, and the
    // slot keys for deletions.
    let mut child = spawn_test_child_with_stdin(
        "strands_child_process",
        CHILD_ENV,
        "stalled-waiter",
        &[
            ("LH_ENDPOINT", etcd.endpoint()),
            ("LH_POOL", pool.into()),
            ("LH_REUSE_IDS", if reuse_ids { "1" } else { "0" }.into()),
        ],
    );
    let out = lines_of(&mut child);
    line_within(&out, "QUEUED", Duration::from_secs(60)).expect("the child queues");
    assert_eq!(
        child_stats(&mut child, &out).watches,
        2,
        "the marker's watch and the slot keys'"
    );

    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
    flood_deletions(&mut c, &etcd, &format!("leasehold/{pool}/slot/")).await;
    let revision = c.get("x", None).await.unwrap().header().unwrap().revision();
    c.compact(revision, None).await.unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child_stats(&mut child, &out).cancels == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "etcd never cancelled the stalled slot watch"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Given the time to set it up again (what it did shows in what it hears, below).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut stats = child_stats(&mut child, &out);
    while (stats.watches < 2 || stats.recreated == 0) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        stats = child_stats(&mut child, &out);
    }

    // The only other holder dies: its slot key goes with its session.
    renewal.abort();
    c.lease_revoke(holder.session_lease().unwrap())
        .await
        .unwrap();
    let granted = line_within(&out, "GRANTED", Duration::from_secs(10)).is_some();
    tell(&mut child, "exit");
    if granted {
        let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        assert!(status.success(), "the child failed: {status}");
        assert!(slot_keys(&mut c, pool).await.is_empty());
    }
    (granted, stats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_watch_that_etcd_cancels_after_a_compaction_is_set_up_again_and_the_head_takes_the_freed_slot()
 {
    let Some(bin) = etcd_binary("a_slot_watch_that_etcd_cancels_after_a_compaction") else {
        return;
    };
    let (granted, stats) = stalled_slot_watch(&bin, false).await;
    assert!(
        granted,
        "the head never took the freed slot: its broker had {stats:?} before the holder died"
    );
    assert_eq!(stats.watches, 2, "both watches were in place again");
    assert!(stats.recreated >= 1, "{stats:?}");
    assert_eq!(
        stats.refused, 0,
        "a fresh watch id is never refused: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_create_that_etcd_refuses_is_counted_and_set_up_again_under_a_new_id() {
    let Some(bin) = etcd_binary("a_watch_create_that_etcd_refuses") else {
        return;
    };
    // The broker sets the cancelled watch up again under its old id, which etcd still holds
    // after a compaction's cancel: etcd refuses that create (a duplicate watch id).
    let (granted, stats) = stalled_slot_watch(&bin, true).await;
    assert!(stats.refused >= 1, "etcd refused the reused id: {stats:?}");
    assert!(
        granted,
        "the head never took the freed slot: its broker had {stats:?} before the holder died"
    );
    assert_eq!(
        stats.watches, 2,
        "in place again, under a new id: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_acquire_is_cleaned_up_after_an_outage_longer_than_any_bound_while_its_session_lives()
 {
    let Some(bin) = etcd_binary("an_abandoned_acquire_outlasts_an_outage") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = connect(&etcd, "nospace", 1).await;
    let waiter = connect(&etcd, "nospace", 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);
    let waiting = acquire_in_background(&waiter, 2);
    let queue_key = wait_queued(&c, &waiter, &request(2)).await;

    // Another client fills etcd's quota: etcd refuses every write (keep-alives go on) until
    // the alarm is disarmed. The waiter gives up its acquire meanwhile.
    let member = c.member_list().await.unwrap().members()[0].id();
    let endpoint = etcd.endpoint();
    let alarm = |action| {
        let endpoint = endpoint.clone();
        async move {
            let mut c = Client::connect([endpoint], None).await.unwrap();
            let mut options = AlarmOptions::new();
            options.with_member(member);
            c.alarm(action, AlarmType::Nospace, Some(options))
                .await
                .unwrap();
        }
    };
    alarm(AlarmAction::Activate).await;
    let refused = c.put("leasehold/elsewhere", "x", None).await;
    assert!(refused.is_err(), "the alarm refuses writes: {refused:?}");
    waiting.abort();
    let _ = waiting.await;

    // Longer than any bound the cleanup once had (sixty seconds): its session is renewed all
    // along, so its queue key would stay the oldest waiter for as long as the broker runs.
    tokio::time::sleep(Duration::from_secs(70)).await;
    assert!(
        exists(&c, &queue_key).await,
        "nothing could be written meanwhile"
    );
    assert!(waiter.session_lease().is_some(), "the session lives");
    alarm(AlarmAction::Deactivate).await;

    wait_until(
        Duration::from_secs(15),
        "the abandoned acquire's queue key goes once etcd takes writes again",
        || {
            let c = c.clone();
            let key = queue_key.clone();
            async move { !exists(&c, &key).await }
        },
    )
    .await;
    // The slot goes to nobody stranded: released, it is free, and the waiter's broker serves.
    renewal.abort();
    holder.release(held).await.unwrap();
    assert!(slot_keys(&mut c, "nospace").await.is_empty());
    let token = tokio::time::timeout(Duration::from_secs(10), waiter.acquire(request(3)))
        .await
        .expect("served")
        .unwrap();
    waiter.release(token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_never_writes_over_a_live_queue_key() {
    let Some(bin) = etcd_binary("a_join_never_writes_over_a_live_queue_key") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = connect(&etcd, "places", 1).await;
    let waiter = connect(&etcd, "places", 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);

    // The waiter's first place, taken and given back once served.
    let first = acquire_in_background(&waiter, 2);
    let place = wait_queued(&c, &waiter, &request(2)).await;
    renewal.abort();
    holder.release(held).await.unwrap();
    let served = first.await.unwrap().unwrap();
    let renewal = keep(&waiter, served);
    assert!(!exists(&c, &place).await);

    // A live key appears at that place (a cleanup of this broker's that could not reach
    // etcd, say): another waiter's, older than anything the waiter joins with next.
    let lease = c.lease_grant(30, None).await.unwrap().id();
    let value = "leasehold/v1 waiter owner=00000000000000aa request=00000000000000bb";
    c.put(
        place.as_str(),
        value,
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .unwrap();
    let before = c.get(place.as_str(), None).await.unwrap().kvs()[0].clone();

    let next = acquire_in_background(&waiter, 3);
    let mine = wait_queued(&c, &waiter, &request(3)).await;
    assert_ne!(mine, place, "the join took another place");
    let after = c.get(place.as_str(), None).await.unwrap().kvs()[0].clone();
    assert_eq!(
        (
            after.value(),
            after.lease(),
            after.create_revision(),
            after.mod_revision()
        ),
        (
            before.value(),
            before.lease(),
            before.create_revision(),
            before.mod_revision()
        ),
        "the live key is untouched"
    );
    assert_eq!(queue_keys(&c, "places").await.len(), 2);

    // Its owner gone, the queue goes on in order: the waiter's next request is served.
    c.lease_revoke(lease).await.unwrap();
    renewal.abort();
    waiter.release(served).await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("served")
        .unwrap()
        .unwrap();
    waiter.release(token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_of_a_slot_index_whose_earlier_token_here_is_not_released_is_handed_on() {
    let Some(bin) = etcd_binary("a_grant_of_a_slot_index_still_held_here") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let busy = connect(&etcd, "park", 1).await;
    let other = connect(&etcd, "park", 1).await;

    // A token whose holder stops keeping it alive while its job hangs: after a TTL the broker
    // gives its slot back to the pool, and keeps its index off limits until it is released.
    let hung = busy.acquire(request(1)).await.unwrap();
    let _ = tokio::time::timeout(Duration::from_millis(50), busy.keep_alive(hung)).await;
    // The same broker waits for the pool, and so does another one behind it.
    let same = acquire_in_background(&busy, 2);
    wait_queued(&c, &busy, &request(2)).await;
    let behind = acquire_in_background(&other, 3);
    wait_queued(&c, &other, &request(3)).await;

    // The TTL hands the slot to the oldest waiter, the same broker's, which cannot hand it out
    // while the hung token holds its index: it hands it on, and the other waiter is served.
    let token = tokio::time::timeout(Duration::from_secs(15), behind)
        .await
        .expect("the grant is handed on instead of idling behind a hung job")
        .unwrap()
        .unwrap();
    assert_eq!(token.slot_id(), hung.slot_id());
    assert!(token.lease_id() > hung.lease_id());
    assert!(!same.is_finished(), "the same broker's request waits again");
    assert_eq!(slot_keys(&mut c, "park").await.len(), 1);

    // The hung job ends; with the slot released too, the same broker's request is served.
    busy.release(hung).await.unwrap();
    other.release(token).await.unwrap();
    let last = tokio::time::timeout(Duration::from_secs(15), same)
        .await
        .expect("served once the earlier token is released")
        .unwrap()
        .unwrap();
    assert!(last.lease_id() > token.lease_id());
    busy.release(last).await.unwrap();
    assert!(slot_keys(&mut c, "park").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_reuses_the_request_id_of_a_release_still_settling_is_refused() {
    let Some(bin) = etcd_binary("an_acquire_reusing_a_settling_request_id") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let proxy = Proxy::start(etcd.client_port());
    let broker = EtcdBroker::connect(
        config(&proxy.endpoint(), "settling", 1).retry_for(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    let token = broker.acquire(request(5)).await.unwrap();
    proxy.blackhole();
    let err = broker.release(token).await.unwrap_err();
    assert_eq!(err.kind(), BrokerErrorKind::DeliveryUnknown, "{err}");
    assert_eq!(
        broker.settling(),
        1,
        "the release settles in the background"
    );
    proxy.heal();

    // The same request again, while its grant is being handed on: refused, never the old
    // grant (it would be held twice).
    let refused = broker.acquire(request(5)).await.unwrap_err();
    assert_eq!(refused.code(), Some("ETCD_REQUEST_SETTLING"), "{refused}");

    // Once settled, the slot is free and the request id serves again with a new grant.
    wait_until(Duration::from_secs(10), "the release settles", || {
        let n = broker.settling();
        async move { n == 0 }
    })
    .await;
    assert!(slot_keys(&mut c, "settling").await.is_empty());
    let again = broker.acquire(request(5)).await.unwrap();
    assert!(again.lease_id() > token.lease_id());
    broker.release(again).await.unwrap();
}

/// Polls `release` once, with the test's own context: its token has left the broker's `held`,
/// and its give-back is on its way (it cannot end: etcd is out of reach).
async fn poll_once(
    release: &mut std::pin::Pin<Box<impl Future<Output = Result<(), leasehold::BrokerError>>>>,
) {
    let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(release.as_mut().poll(cx))).await;
    assert!(
        polled.is_pending(),
        "the release waits for etcd: {polled:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_reuses_the_request_id_of_a_release_in_flight_is_refused_at_once() {
    let Some(bin) = etcd_binary("an_acquire_reusing_a_released_request_id_in_flight") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let proxy = Proxy::start(etcd.client_port());
    let broker = EtcdBroker::connect(
        config(&proxy.endpoint(), "inflight", 1).retry_for(Duration::from_secs(20)),
    )
    .await
    .unwrap();
    let token = broker.acquire(request(7)).await.unwrap();
    proxy.blackhole();
    let mut release = Box::pin(broker.release(token));
    poll_once(&mut release).await;

    // The same request again while its release is in flight: refused without a word to etcd
    // (which would still say the request holds the slot under the token being released).
    let refused = tokio::time::timeout(Duration::from_secs(3), broker.acquire(request(7)))
        .await
        .expect("refused at once, without waiting on etcd")
        .unwrap_err();
    assert_eq!(refused.code(), Some("ETCD_REQUEST_SETTLING"), "{refused}");

    proxy.heal();
    release.await.unwrap();
    assert!(slot_keys(&mut c, "inflight").await.is_empty());
    let again = broker.acquire(request(7)).await.unwrap();
    assert!(again.lease_id() > token.lease_id());
    broker.release(again).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_reuses_the_request_id_of_a_release_in_flight_never_gets_the_released_token()
 {
    let Some(bin) = etcd_binary("an_acquire_never_gets_a_token_in_release") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let proxy = Proxy::start(etcd.client_port());
    let broker = EtcdBroker::connect(
        config(&proxy.endpoint(), "inflight2", 1).retry_for(Duration::from_secs(20)),
    )
    .await
    .unwrap();
    let token = broker.acquire(request(8)).await.unwrap();
    // The release's transaction is lost on the way (the proxy heals by closing the
    // connection it was sent on): etcd still says the request holds the slot under `token`.
    proxy.blackhole();
    let mut release = Box::pin(broker.release(token));
    poll_once(&mut release).await;
    proxy.heal();

    let reused = tokio::time::timeout(Duration::from_secs(10), broker.acquire(request(8)))
        .await
        .expect("the acquire ends");
    match reused {
        Ok(t) => panic!("{t} handed out while its release ({token}) is in flight"),
        Err(e) => assert_eq!(e.code(), Some("ETCD_REQUEST_SETTLING"), "{e}"),
    }

    release.await.unwrap();
    assert!(slot_keys(&mut c, "inflight2").await.is_empty());
    let again = broker.acquire(request(8)).await.unwrap();
    assert!(again.lease_id() > token.lease_id());
    broker.release(again).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_key_among_the_slot_keys_does_not_count_as_a_held_slot() {
    let Some(bin) = etcd_binary("a_stray_key_among_the_slot_keys") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = connect(&etcd, "bak", 2).await;
    let waiter = connect(&etcd, "bak", 2).await;
    // Sorts among the slot keys, inside the pool's slot range.
    let stray = "leasehold/bak/slot/000000.bak";
    c.put(stray, "a copy someone kept", None).await.unwrap();

    let a = holder.acquire(request(1)).await.unwrap();
    let b = holder.acquire(request(2)).await.unwrap();
    let (keep_a, keep_b) = (keep(&holder, a), keep(&holder, b));
    // The pool is full: the waiter queues, and counts two held slots, not three.
    let first = acquire_in_background(&waiter, 3);
    wait_queued(&c, &waiter, &request(3)).await;
    keep_a.abort();
    holder.release(a).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("handed over")
        .unwrap()
        .unwrap();
    let keep_got = keep(&waiter, got);
    keep_b.abort();
    holder.release(b).await.unwrap();

    // One slot held and one free; the waiter's broker, which has seen a queue, joins it and
    // counts what is held as it joins: one slot, not the stray key too.
    let second = tokio::time::timeout(Duration::from_secs(10), waiter.acquire(request(4)))
        .await
        .expect("a free slot is taken, not waited for behind a key that holds nothing")
        .unwrap();
    assert_ne!(second.slot_id(), got.slot_id());
    keep_got.abort();
    waiter.release(got).await.unwrap();
    waiter.release(second).await.unwrap();
    let keys = slot_keys(&mut c, "bak").await;
    assert_eq!(keys.len(), 1, "only the stray key is left: {keys:?}");
    assert!(keys[0].0.ends_with(".bak"));
}

/// A tracing subscriber that runs `then` when the broker logs that a waiter whose place is gone
/// asks etcd whether its session lives (just before it asks), and counts how often.
struct OnSessionCheck {
    then: Box<dyn Fn() + Send + Sync>,
    seen: Arc<std::sync::atomic::AtomicUsize>,
}

impl tracing::Subscriber for OnSessionCheck {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        let Message(text) = message;
        if text.contains("etcd is asked whether its session lives") {
            self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (self.then)();
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_place_is_gone_while_etcd_does_not_answer_keeps_its_session() {
    use tracing::instrument::WithSubscriber;
    let Some(bin) = etcd_binary("a_waiter_whose_place_is_gone_while_etcd_does_not_answer") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let proxy = Arc::new(Proxy::start(etcd.client_port()));
    // A TTL well past the outage below (the session lives through it), a short bound on calls.
    let waiter = Arc::new(
        EtcdBroker::connect(
            config(&proxy.endpoint(), "blip", 2)
                .ttl(Duration::from_secs(10))
                .retry_for(Duration::from_secs(1)),
        )
        .await
        .unwrap(),
    );
    let holder = connect(&etcd, "blip", 2).await;
    // The waiter's broker holds a slot under its session, the other broker the other one.
    let mine = waiter.acquire(request(1)).await.unwrap();
    let keep_mine = keep(&waiter, mine);
    let theirs = holder.acquire(request(9)).await.unwrap();
    let keep_theirs = keep(&holder, theirs);
    let session = waiter.session_lease().expect("a session");

    // A waiter, cut off from etcd the moment it asks whether its session lives.
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let cut = {
        let proxy = Arc::clone(&proxy);
        tracing::Dispatch::new(OnSessionCheck {
            then: Box::new(move || proxy.blackhole()),
            seen: Arc::clone(&seen),
        })
    };
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(request(2)).await }.with_subscriber(cut))
    };
    let place = wait_queued(&c, &waiter, &request(2)).await;
    wait_until(
        Duration::from_secs(10),
        "the waiter watches its marker (and the slot watch is in place)",
        || {
            let n = waiter.watch_count();
            async move { n == 2 }
        },
    )
    .await;

    // Someone deletes its place, then the other broker's release frees its slot: the waiter
    // looks, finds its place gone, and asks etcd about its session while etcd is cut off.
    c.delete(place.as_str(), None).await.unwrap();
    keep_theirs.abort();
    holder.release(theirs).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("the wait ends")
        .unwrap()
        .expect_err("its place is gone");
    assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1, "{err}");
    proxy.heal();
    let kept = waiter.session_lease();

    // Closing revokes the session etcd never said was gone: nothing is left under it.
    keep_mine.abort();
    waiter.close().await.unwrap();
    let left: Vec<String> = c
        .get("leasehold/blip/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap()
        .kvs()
        .iter()
        .filter(|kv| kv.lease() == session)
        .map(|kv| kv.key_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        (err.code(), kept, left),
        (Some("ETCD_UNAVAILABLE"), Some(session), Vec::new()),
        "an unanswered question is not an expiry: the wait ends unavailable (not \
         ETCD_SESSION_EXPIRED), the session is kept, and close revokes it: {err}"
    );
}
