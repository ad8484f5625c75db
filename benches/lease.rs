//! Lease round trip: `acquire` + `release` of an explicit lease, uncontended (8 slots, one
//! caller), next to its floors measured in the same run (see `BENCHMARKS.md`):
//!
//! - `tokio_semaphore`: a tokio `Semaphore` permit acquired and dropped;
//! - `mpsc_oneshot`: a tokio mpsc + oneshot round trip to a task;
//! - `ractor_call`: one raw ractor `call` to an actor that answers at once: the target's floor,
//!   acquire + release ≤ 2.2× of it;
//! - `ractor_call_x2`: two raw calls in a row, context (acquire and release are each a message
//!   to the supervisor actor);
//! - `shape_floor`: the same lease from the shape floor (`floor/owner.rs`: one owner actor
//!   written by hand, requests on a shared queue, a doorbell only when it sleeps, answers by
//!   oneshot, the release awaited): target ≤ 1.3× of it.
//!
//! After the ratios, what noise does not move, per acquire + release over an untimed run:
//! leasehold's messages, doorbells and polls (`leasehold::Counts`), and the shape floor's
//! doorbells, wakes and requests drained per wake.
//!
//! The web console's cost on the same round trip is leasehold-console's `console` bench.
//!
//! criterion ids are `lease_round_trip/<function>/slots=8`. The last "benchmark", `summary`,
//! prints the ratio rows from the samples criterion took above. `-- --test` runs each once.

mod floor;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ractor::Actor;
use tokio::sync::{Semaphore, SemaphorePermit};

use floor::{
    Owner, PingActor, acquire_release, key, owner_acquire_release, ratio_row, start_supervisor,
    table_end, table_start, timed,
};
use leasehold::Counts;

const GROUP: &str = "lease_round_trip";
const SAMPLES: usize = 30;
const PARAM: &str = "slots=8";
/// acquire + release ≤ 3.0× one raw ractor call.
const TARGET_ONE_CALL: f64 = 3.0;
/// acquire + release ≤ 1.3× the shape floor's.
const TARGET_SHAPE: f64 = 1.3;
/// Round trips of the untimed counted run.
const COUNTED: u64 = 10_000;

/// What each side did per acquire + release in the counted run, for the summary.
static COUNTED_FIGURES: std::sync::Mutex<Option<(Counts, floor::OwnerCounts, u64)>> =
    std::sync::Mutex::new(None);

fn lease_round_trip(c: &mut Criterion) {
    let rt = floor::runtime();
    let sup = rt.block_on(start_supervisor(8, None));
    let sem = Arc::new(Semaphore::new(8));
    let (ping, ping_join) = rt
        .block_on(Actor::spawn(None, PingActor, ()))
        .expect("ping actor starts");
    let echo = floor::spawn_echo(&rt);
    let (owner, owner_join) = rt.block_on(Owner::start(8));

    let mut group = c.benchmark_group(GROUP);
    group
        .sample_size(SAMPLES)
        .throughput(Throughput::Elements(1));
    floor::times(
        &mut group,
        Duration::from_millis(500),
        Duration::from_secs(2),
    );

    let k = key(GROUP, "leasehold", PARAM);
    group.bench_function(BenchmarkId::new("leasehold", PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let start = Instant::now();
                acquire_release(&sup, iters).await;
                start.elapsed()
            }
        });
    });

    let k = key(GROUP, "tokio_semaphore", PARAM);
    group.bench_function(BenchmarkId::new("tokio_semaphore", PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let sem = Arc::clone(&sem);
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let permit: SemaphorePermit<'_> = sem.acquire().await.expect("semaphore open");
                    drop(permit);
                }
                start.elapsed()
            }
        });
    });

    let k = key(GROUP, "mpsc_oneshot", PARAM);
    group.bench_function(BenchmarkId::new("mpsc_oneshot", PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let echo = echo.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    floor::echo(&echo).await;
                }
                start.elapsed()
            }
        });
    });

    let k = key(GROUP, "ractor_call", PARAM);
    group.bench_function(BenchmarkId::new("ractor_call", PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let ping = ping.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    floor::ping(&ping).await;
                }
                start.elapsed()
            }
        });
    });

    let k = key(GROUP, "shape_floor", PARAM);
    group.bench_function(BenchmarkId::new("shape_floor", PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let owner = owner.clone();
            async move {
                let start = Instant::now();
                owner_acquire_release(&owner, iters).await;
                start.elapsed()
            }
        });
    });

    // Context, not a target: acquire + release is two messages to the actor, each answered.
    let k = key(GROUP, "ractor_call_x2", PARAM);
    group.bench_function(BenchmarkId::new("ractor_call_x2", PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let ping = ping.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    floor::ping(&ping).await;
                    floor::ping(&ping).await;
                }
                start.elapsed()
            }
        });
    });
    group.finish();

    // Untimed: what each side does per round trip, on a worker thread as above.
    let n = if floor::test_mode() { 100 } else { COUNTED };
    let (sup2, owner2) = (sup.clone(), owner.clone());
    let figures = rt.block_on(async move {
        tokio::spawn(async move {
            let before = Counts::now();
            acquire_release(&sup2, n).await;
            let counts = Counts::now().since(before);
            owner2.take_counts();
            owner_acquire_release(&owner2, n).await;
            (counts, owner2.take_counts())
        })
        .await
        .expect("the counted run")
    });
    *COUNTED_FIGURES.lock().expect("figures") = Some((figures.0, figures.1, n));

    drop(echo);
    rt.block_on(async {
        owner.close(owner_join).await;
        sup.shutdown().await.expect("shutdown");
        ping.stop(None);
        ping_join.await.expect("ping actor joins");
    });
}

fn summary(_c: &mut Criterion) {
    if !table_start("lease round trip", "per acquire + release") {
        return;
    }
    let k = |f: &str| key(GROUP, f, PARAM);
    ratio_row(
        "acquire+release / tokio Semaphore acquire+drop",
        &k("leasehold"),
        &k("tokio_semaphore"),
        1,
        None,
    );
    ratio_row(
        "acquire+release / mpsc+oneshot round trip",
        &k("leasehold"),
        &k("mpsc_oneshot"),
        1,
        None,
    );
    ratio_row(
        "**acquire+release / 1 raw ractor call**",
        &k("leasehold"),
        &k("ractor_call"),
        1,
        Some(TARGET_ONE_CALL),
    );
    ratio_row(
        "acquire+release / 2 raw ractor calls",
        &k("leasehold"),
        &k("ractor_call_x2"),
        1,
        None,
    );
    ratio_row(
        "**acquire+release / the shape floor's** (one owner actor by hand)",
        &k("leasehold"),
        &k("shape_floor"),
        1,
        Some(TARGET_SHAPE),
    );
    if let Some((c, o, n)) = *COUNTED_FIGURES.lock().expect("figures") {
        let per = |x: u64| x as f64 / n as f64;
        println!();
        println!("What noise does not move, per acquire + release ({n} round trips, untimed):");
        println!();
        println!(
            "| side | messages / lease | doorbells / lease | wakes / lease | requests / wake |"
        );
        println!("|---|---|---|---|---|");
        println!(
            "| leasehold | {:.2} | {:.2} | {:.2} (polls) | - |",
            per(c.messages),
            per(c.rings),
            per(c.polls)
        );
        println!(
            "| shape floor | {:.2} (requests) | {:.2} | {:.2} (actor turns) | {:.2} |",
            per(o.drained),
            per(o.rings),
            per(o.wakes),
            o.drained as f64 / o.wakes.max(1) as f64
        );
    }
    table_end();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = lease_round_trip, summary
}
criterion_main!(benches);
