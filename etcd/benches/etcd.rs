//! etcd: `EtcdBroker` acquire + release, driven
//! directly and through a supervisor (uncontended, 8 slots), against one bare etcd put, all on a
//! single-member etcd on loopback that the bench starts (data dir on the scratch file system,
//! tmpfs when there is one). The etcd binary is `$LEASEHOLD_ETCD_BIN` or `etcd` on `PATH`;
//! without one it prints a loud skip line and measures nothing; with `LEASEHOLD_REQUIRE_ETCD=1`
//! (CI) a missing binary is a panic.
//!
//! criterion ids are `etcd/<bare_put|etcd_broker|leasehold>/slots=8`. The last "benchmark",
//! `summary`, prints the ratio rows from the samples criterion took above. `-- --test` runs each
//! once.

#[allow(dead_code, unreachable_pub)]
#[path = "../tests/etcd_support/server.rs"]
mod etcd_server;
#[path = "../../benches/floor/mod.rs"]
mod floor;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use leasehold::{AcquireRequest, SlotBroker, Supervisor};
use leasehold_etcd::{EtcdBroker, EtcdConfig};
use tokio::runtime::Runtime;

use etcd_server::{Etcd, bench_data_base, find_etcd};
use floor::{acquire_release, key, ratio_row, runtime, table_end, table_start, timed};

const ETCD: &str = "etcd";
const ETCD_BARE_PUT: &str = "bare_put";
const ETCD_BROKER: &str = "etcd_broker";
const ETCD_SUPERVISOR: &str = "leasehold";
/// The pool's capacity; every figure is uncontended (one acquire at a time).
const ETCD_SLOTS: u32 = 8;
const ETCD_SAMPLES: usize = 20;
/// The floor's key and value (the value about as long as a leasehold slot record), outside
/// the pool's prefix.
const FLOOR_KEY: &str = "bench-floor/put";
const FLOOR_VALUE: &str = "leasehold/v1 holder lease=0123456789abcdef";
/// Set to `1` (CI does) to make a missing etcd binary a failure instead of a skip.
const REQUIRE_ETCD_ENV: &str = "LEASEHOLD_REQUIRE_ETCD";

/// `$LEASEHOLD_ETCD_BIN`, else `etcd` on `PATH`; `None` (after a loud skip line) when there
/// is none, a panic when CI requires one.
fn etcd_binary() -> Option<PathBuf> {
    let found = find_etcd(None);
    if found.is_none() {
        if std::env::var(REQUIRE_ETCD_ENV).as_deref() == Ok("1") {
            panic!(
                "{REQUIRE_ETCD_ENV}=1 but no etcd binary was found (apt-get install etcd-server)"
            );
        }
        eprintln!(
            "\n*** SKIPPED etcd benchmarks: no etcd binary (apt-get install etcd-server) ***\n"
        );
    }
    found
}

/// What the group measures against: started on the first benchmark that runs, so that a
/// filter that skips the whole group starts no etcd.
struct EtcdBench {
    client: etcd_client::Client,
    broker: Arc<EtcdBroker>,
    next_request: Arc<AtomicU64>,
    sup: Supervisor,
    server: Etcd,
}

fn start_bench(rt: &Runtime, bin: &Path) -> EtcdBench {
    // The data dir on tmpfs when there is one: the figures are round trips and etcd's own work,
    // not a disk's fsync.
    let server = Etcd::start_in(bin, bench_data_base().as_deref());
    let endpoint = server.endpoint();
    println!(
        "etcd benchmarks on {} at {endpoint}, data dir {}",
        bin.display(),
        server.data_dir().display()
    );
    let (client, broker, sup) = rt.block_on(async {
        let client = etcd_client::Client::connect([endpoint.as_str()], None)
            .await
            .expect("etcd client connects");
        let config = EtcdConfig::new([endpoint.as_str()], "bench", ETCD_SLOTS);
        // Two brokers on the same pool: one driven directly, one owned by the supervisor.
        let broker = EtcdBroker::connect(config.clone())
            .await
            .expect("broker connects");
        let sup_broker = EtcdBroker::connect(config).await.expect("broker connects");
        let sup = Supervisor::builder()
            .broker(sup_broker)
            .start()
            .await
            .expect("supervisor starts");
        (client, Arc::new(broker), sup)
    });
    EtcdBench {
        client,
        broker,
        next_request: Arc::new(AtomicU64::new(1)),
        sup,
        server,
    }
}

/// A bare etcd put against `EtcdBroker` acquire + release (direct and through a supervisor),
/// all on one loopback etcd. One broker acquire is a lease grant and two transactions (join
/// the queue and read the pool, claim a slot and read the pool); its release is one revoke.
fn etcd(c: &mut Criterion) {
    let Some(bin) = etcd_binary() else {
        return;
    };
    let rt = runtime();
    let mut bench: Option<EtcdBench> = None;

    let mut group = c.benchmark_group(ETCD);
    group
        .sample_size(ETCD_SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    let p = format!("slots={ETCD_SLOTS}");

    let k = key(ETCD, ETCD_BARE_PUT, &p);
    group.bench_function(BenchmarkId::new(ETCD_BARE_PUT, &p), |b| {
        let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
        timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
            let mut client = s.client.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    client
                        .put(FLOOR_KEY, FLOOR_VALUE, None)
                        .await
                        .expect("etcd put");
                }
                start.elapsed()
            }
        });
    });

    let k = key(ETCD, ETCD_BROKER, &p);
    group.bench_function(BenchmarkId::new(ETCD_BROKER, &p), |b| {
        let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
        timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
            let (broker, next) = (Arc::clone(&s.broker), Arc::clone(&s.next_request));
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let id = next.fetch_add(1, Ordering::Relaxed);
                    let token = broker
                        .acquire(AcquireRequest::new(id, None))
                        .await
                        .expect("broker acquire");
                    broker.release(token).await.expect("broker release");
                }
                start.elapsed()
            }
        });
    });

    let k = key(ETCD, ETCD_SUPERVISOR, &p);
    group.bench_function(BenchmarkId::new(ETCD_SUPERVISOR, &p), |b| {
        let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
        timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
            let sup = s.sup.clone();
            async move {
                let start = Instant::now();
                acquire_release(&sup, iters).await;
                start.elapsed()
            }
        });
    });
    group.finish();

    if let Some(EtcdBench {
        client,
        broker,
        sup,
        server,
        ..
    }) = bench
    {
        rt.block_on(sup.shutdown()).expect("shutdown");
        drop((client, broker, sup));
        // The runtime (and every etcd client task on it) goes before the server does.
        drop(rt);
        drop(server);
    }
}

// ---------------------------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------------------------

/// Uncontended acquire + release in at most two consensus writes: ≤ 2.5× one bare put.
const TARGET_BARE_PUT: f64 = 2.5;

/// The etcd rows: `EtcdBroker` acquire + release, alone and through a supervisor, over one bare
/// etcd put on the same loopback server.
fn summary(_c: &mut Criterion) {
    if !table_start("etcd", "per acquire + release, or per put") {
        return;
    }
    let k = |f: &str| key(ETCD, f, &format!("slots={ETCD_SLOTS}"));
    ratio_row(
        "etcd acquire+release (broker) / bare etcd put",
        &k(ETCD_BROKER),
        &k(ETCD_BARE_PUT),
        1,
        Some(TARGET_BARE_PUT),
    );
    ratio_row(
        "etcd acquire+release (supervisor) / bare etcd put",
        &k(ETCD_SUPERVISOR),
        &k(ETCD_BARE_PUT),
        1,
        None,
    );
    table_end();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = etcd, summary
}
criterion_main!(benches);
