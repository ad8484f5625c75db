//! A process on `EtcdBroker` that shuts down and returns from `main` leaves nothing in etcd:
//! no session lease, no key, and no queue place that a release would hand a slot to. The
//! process is real (this test binary run again with `LEASEHOLD_EXIT_CHILD` set, entering
//! through `exit_child_process`), so its runtime really ends when it exits.
//!
//! The children use a 10 s TTL: what they would leave behind stays for seconds after they
//! exit, well within every check here.

mod etcd_support;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use etcd_support::{
    Etcd, etcd_binary, lines_of, next_line_with, spawn_test_child_with_stdin, tell, test_config,
    wait_for_word,
};
use leasehold::{AcquireRequest, JobSpec, SlotBroker, Supervisor};
use leasehold_etcd::{EtcdBroker, EtcdConfig};

const CHILD_ENV: &str = "LEASEHOLD_EXIT_CHILD";

/// The children's settings: a TTL long enough that anything they leave is still there when
/// the parent looks.
fn child_config(endpoint: &str, pool: &str) -> EtcdConfig {
    test_config(endpoint, pool, 1).ttl(Duration::from_secs(10))
}

fn say(line: &str) {
    println!("{line}");
    std::io::stdout().flush().unwrap();
}

// ---------------------------------------------------------------------------------------------
// The child process.

/// Runs a job to its end, starts another that holds its slot until cancelled, says which
/// session it uses, then shuts the supervisor down, closes the broker and returns.
async fn finish(endpoint: &str, pool: &str) {
    let broker = Arc::new(
        EtcdBroker::connect(child_config(endpoint, pool))
            .await
            .unwrap(),
    );
    let sup = Supervisor::builder()
        .broker(Arc::clone(&broker))
        .start()
        .await
        .unwrap();
    sup.run(JobSpec::new("done").unwrap(), |_ctx| async {
        Ok::<_, String>(())
    })
    .await
    .unwrap();
    let (granted, running) = tokio::sync::oneshot::channel();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("running").unwrap(), |ctx| async move {
                let _ = granted.send(());
                ctx.cancelled().await;
                Ok::<_, String>(())
            })
            .await
        })
    };
    running.await.unwrap();
    say(&format!("SESSION {}", broker.session_lease().unwrap()));
    sup.shutdown().await.unwrap();
    let _ = job.await.unwrap();
    broker.close().await.unwrap();
    say("CLOSED");
}

/// Waits for a slot in a job (the pool is full), until the parent says `exit`; then shuts the
/// supervisor down, closes the broker and returns.
async fn wait_then_exit(endpoint: &str, pool: &str) {
    let broker = Arc::new(
        EtcdBroker::connect(child_config(endpoint, pool))
            .await
            .unwrap(),
    );
    let sup = Supervisor::builder()
        .broker(Arc::clone(&broker))
        .start()
        .await
        .unwrap();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("waiter").unwrap(), |_ctx| async {
                Ok::<_, String>(())
            })
            .await
        })
    };
    say("WAITING");
    tokio::task::spawn_blocking(|| wait_for_word("exit"))
        .await
        .unwrap();
    sup.shutdown().await.unwrap();
    let outcome = job.await.unwrap();
    assert!(outcome.is_err(), "the waiter got no slot: {outcome:?}");
    broker.close().await.unwrap();
    say("CLOSED");
}

/// The entry point of child processes; run directly (no child mode), it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_child_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap();
    match mode.as_str() {
        "finish" => finish(&var("LH_ENDPOINT"), &var("LH_POOL")).await,
        "wait" => wait_then_exit(&var("LH_ENDPOINT"), &var("LH_POOL")).await,
        other => panic!("unknown child mode {other}"),
    }
}

fn spawn_child(mode: &str, etcd: &Etcd, pool: &str) -> etcd_support::ChildGuard {
    spawn_test_child_with_stdin(
        "exit_child_process",
        CHILD_ENV,
        mode,
        &[("LH_ENDPOINT", etcd.endpoint()), ("LH_POOL", pool.into())],
    )
}

// ---------------------------------------------------------------------------------------------

/// Every key under the pool, with its lease.
async fn pool_keys(c: &mut Client, pool: &str) -> Vec<(String, i64)> {
    c.get(
        format!("leasehold/{pool}/"),
        Some(GetOptions::new().with_prefix()),
    )
    .await
    .unwrap()
    .kvs()
    .iter()
    .map(|kv| (kv.key_str().unwrap().to_owned(), kv.lease()))
    .collect()
}

/// Whether etcd still knows the lease (its remaining TTL, -1 once it is gone).
async fn lease_alive(c: &mut Client, lease: i64) -> bool {
    c.lease_time_to_live(lease, None).await.unwrap().ttl() > 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_shuts_down_and_exits_leaves_no_lease_and_no_key_in_etcd() {
    let Some(bin) = etcd_binary("a_process_that_shuts_down_and_exits") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let mut child = spawn_child("finish", &etcd, "exit");
    let out = lines_of(&mut child);
    let session: i64 = next_line_with(&out, "SESSION")
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "the child failed: {status}");

    // It has returned from main: what it wrote is gone now, not one TTL (10 s) later.
    assert!(
        !lease_alive(&mut c, session).await,
        "the exited process's session lease {session:x} is still alive"
    );
    assert_eq!(
        pool_keys(&mut c, "exit").await,
        vec![("leasehold/exit/capacity".to_owned(), 0)],
        "only the capacity record stays"
    );
    // The pool serves at once.
    let broker = EtcdBroker::connect(test_config(&etcd.endpoint(), "exit", 1))
        .await
        .unwrap();
    let token = tokio::time::timeout(
        Duration::from_secs(2),
        broker.acquire(AcquireRequest::new(1, None)),
    )
    .await
    .expect("the slot is free at once")
    .unwrap();
    broker.release(token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_process_that_shuts_down_and_exits_does_not_strand_the_next_hand_off() {
    let Some(bin) = etcd_binary("a_waiting_process_that_shuts_down_and_exits") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let holder = Arc::new(
        EtcdBroker::connect(test_config(&etcd.endpoint(), "strand", 1))
            .await
            .unwrap(),
    );
    let held = holder.acquire(AcquireRequest::new(1, None)).await.unwrap();
    // Kept alive as a supervisor would (else the broker gives it back after a TTL).
    let renewal = {
        let holder = Arc::clone(&holder);
        tokio::spawn(async move { holder.keep_alive(held).await })
    };

    // A process queues for the slot ...
    let mut child = spawn_child("wait", &etcd, "strand");
    let out = lines_of(&mut child);
    next_line_with(&out, "WAITING");
    let queue = |c: &Client| {
        let mut c = c.clone();
        async move {
            c.get(
                "leasehold/strand/queue/",
                Some(GetOptions::new().with_prefix()),
            )
            .await
            .unwrap()
            .kvs()
            .iter()
            .map(|kv| kv.lease())
            .collect::<Vec<i64>>()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let dead = loop {
        if let [lease] = queue(&c).await.as_slice() {
            break *lease;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the child never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // ... and a live acquirer queues behind it.
    let next = Arc::new(
        EtcdBroker::connect(test_config(&etcd.endpoint(), "strand", 1))
            .await
            .unwrap(),
    );
    let waiting = {
        let next = Arc::clone(&next);
        tokio::spawn(async move { next.acquire(AcquireRequest::new(2, None)).await })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while queue(&c).await.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the live waiter never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The waiting process shuts down and returns from main.
    tell(&mut child, "exit");
    next_line_with(&out, "CLOSED");
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "the child failed: {status}");
    let left: Vec<_> = pool_keys(&mut c, "strand")
        .await
        .into_iter()
        .filter(|(_, lease)| *lease == dead)
        .collect();
    assert!(left.is_empty(), "the exited process left {left:?}");
    assert!(
        !lease_alive(&mut c, dead).await,
        "the exited process's session lease {dead:x} is still alive"
    );

    // The release hands the slot straight to the live waiter, in its own transaction.
    renewal.abort();
    holder.release(held).await.unwrap();
    let slot = c.get("leasehold/strand/slot/000000", None).await.unwrap();
    let to = slot.kvs().first().map(|kv| kv.lease());
    assert_eq!(
        to,
        next.session_lease(),
        "handed to the live waiter (the exited one's session was {dead:x})"
    );
    let token = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the live waiter is served at once")
        .unwrap()
        .unwrap();
    assert!(token.lease_id() > held.lease_id());
    next.release(token).await.unwrap();
}
