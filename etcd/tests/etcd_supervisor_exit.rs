//! What the supervisor owes an `EtcdBroker`, through the supervisor only: acquires
//! whose futures are dropped leave the etcd queue at once (behaviour 8), and a process that
//! calls `shutdown()` and returns from `main` leaves no session lease and no key in etcd,
//! because `shutdown` awaits `SlotBroker::close` under the cleanup timeout.
//!
//! Both need the supervisor's side (its core drops a broker acquire whose waiter is gone; its
//! shutdown awaits the broker's close, as its last step), and failed before it. The child
//! process is this test binary run again with `LEASEHOLD_SUP_EXIT_CHILD` set, entering through
//! `supervisor_exit_child_process`.

mod etcd_support;

use std::io::Write;
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use etcd_support::{Etcd, etcd_binary, lines_of, next_line_with, spawn_test_child, test_config};
use leasehold::{AcquireRequest, JobSpec, SlotBroker, Supervisor};
use leasehold_etcd::EtcdBroker;

const CHILD_ENV: &str = "LEASEHOLD_SUP_EXIT_CHILD";

async fn queue_keys(c: &mut Client, pool: &str) -> Vec<(String, i64)> {
    c.get(
        format!("leasehold/{pool}/queue/"),
        Some(GetOptions::new().with_prefix()),
    )
    .await
    .unwrap()
    .kvs()
    .iter()
    .map(|kv| (kv.key_str().unwrap().to_owned(), kv.lease()))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_acquires_leave_no_queue_key() {
    let Some(bin) = etcd_binary("dropped_acquires_leave_no_queue_key") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let holder = std::sync::Arc::new(
        EtcdBroker::connect(test_config(&etcd.endpoint(), "sdrop", 1))
            .await
            .unwrap(),
    );
    let held = holder.acquire(AcquireRequest::new(1, None)).await.unwrap();
    // Kept alive (else the broker gives it back after a TTL, to the waiter under test).
    let renewal = {
        let holder = std::sync::Arc::clone(&holder);
        tokio::spawn(async move { holder.keep_alive(held).await })
    };
    let broker = EtcdBroker::connect(test_config(&etcd.endpoint(), "sdrop", 1))
        .await
        .unwrap();
    let sup = Supervisor::builder().broker(broker).start().await.unwrap();

    // Eight acquires wait on the full pool; the supervisor has asked the broker for a slot.
    let acquires: Vec<_> = (0..8)
        .map(|_| {
            let sup = sup.clone();
            tokio::spawn(async move { sup.acquire().await })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while queue_keys(&mut c, "sdrop").await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "nobody queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every one of them is dropped: nobody waits here any more, so nothing may wait in etcd.
    for a in &acquires {
        a.abort();
    }
    for a in acquires {
        assert!(a.await.unwrap_err().is_cancelled());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left = queue_keys(&mut c, "sdrop").await;
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a queue key is left under the supervisor's live session after every acquire was \
             dropped: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sup.stats().waiting, 0);
    // The holder's release frees the slot: nothing is handed to a waiter that is gone.
    renewal.abort();
    holder.release(held).await.unwrap();
    let slot = c.get("leasehold/sdrop/slot/000000", None).await.unwrap();
    assert!(slot.kvs().is_empty(), "the slot went to a dropped acquire");
    sup.shutdown().await.unwrap();
}

/// The child: a job held until shutdown, then `shutdown()` only (no explicit close), then
/// return from main.
async fn shut_down_only(endpoint: &str, pool: &str) {
    let broker = std::sync::Arc::new(
        EtcdBroker::connect(test_config(endpoint, pool, 1).ttl(Duration::from_secs(10)))
            .await
            .unwrap(),
    );
    let sup = Supervisor::builder()
        .broker(std::sync::Arc::clone(&broker))
        .start()
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
    println!("SESSION {}", broker.session_lease().unwrap());
    std::io::stdout().flush().unwrap();
    sup.shutdown().await.unwrap();
    let _ = job.await.unwrap();
}

/// The entry point of child processes; run directly (no child mode), it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supervisor_exit_child_process() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("shutdown") {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap();
    shut_down_only(&var("LH_ENDPOINT"), &var("LH_POOL")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_calls_shutdown_and_exits_leaves_no_lease_and_no_key_in_etcd() {
    let Some(bin) = etcd_binary("a_process_that_calls_shutdown_and_exits") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let mut child = spawn_test_child(
        "supervisor_exit_child_process",
        CHILD_ENV,
        "shutdown",
        &[
            ("LH_ENDPOINT", etcd.endpoint()),
            ("LH_POOL", "sexit".into()),
        ],
    );
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
    let ttl = c.lease_time_to_live(session, None).await.unwrap().ttl();
    assert!(
        ttl <= 0,
        "the exited process's session lease {session:x} is alive for {ttl} s more"
    );
    let keys = c
        .get("leasehold/sexit/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let left: Vec<&str> = keys
        .kvs()
        .iter()
        .map(|kv| kv.key_str().unwrap())
        .filter(|k| !k.ends_with("/capacity"))
        .collect();
    assert!(left.is_empty(), "the exited process left {left:?}");
}
