//! Contention: `workers` tasks share `slots` slots, each doing its share of `TOTAL_OPS`
//! acquire, a yielding body (`tokio::task::yield_now`, so that a holder lets the others run and
//! queue), release; leasehold (explicit leases) next to a tokio `Semaphore` with the same
//! workload, measured in the same run (see `BENCHMARKS.md`). The figure is the time per lease:
//! one iteration's time over `TOTAL_OPS`.
//!
//! The shape floor runs the same workload: one owner actor written by hand that leases slots by
//! message (`floor/owner.rs`), leasehold's shape with nothing else; a `Semaphore` hands a permit
//! over inside the releasing task's poll, which no lease by message can.
//!
//! The targets are 64 workers / 8 slots ≤ 1.3× the shape floor's and ≤ 3.0× the semaphore's
//! time per lease; 1024 / 8 is printed next to them, and the rest of the workers × slots table as
//! context. Per-acquire wait percentiles (p50 / p99 / p99.9) are collected once per pair, in an
//! untimed pass before criterion's, and printed after the ratio rows with what noise does not
//! move over that pass: leasehold's doorbells and polls per lease (`leasehold::Counts`), the
//! shape floor's doorbells, actor turns per lease and requests drained per turn.
//!
//! criterion ids are `contention/<leasehold|shape_floor|tokio_semaphore>/workers=W,slots=S`. The last
//! "benchmark", `summary`, prints the rows from the samples criterion took above. `-- --test`
//! runs each once.

mod floor;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use hdrhistogram::Histogram;
use leasehold::{Counts, Lease, Supervisor};
use tokio::sync::{Barrier, Semaphore, SemaphorePermit};

use floor::{
    Owner, OwnerCounts, fmt_ns, key, ratio_row, start_supervisor, table_end, table_start, timed,
};

const GROUP: &str = "contention";
const SAMPLES: usize = 10;
const WORKERS: [usize; 3] = [8, 64, 1024];
const SLOTS: [u32; 3] = [1, 8, 32];
/// acquire + release operations per iteration, split evenly over the workers.
const TOTAL_OPS: u64 = 8192;
/// 64 workers / 8 slots ≤ 3.0× tokio Semaphore's time per lease.
const TARGET: (usize, u32, f64) = (64, 8, 3.0);
/// ... and ≤ 1.3× the shape floor's.
const TARGET_SHAPE: f64 = 1.3;
/// Printed next to the target's row.
const ALSO: (usize, u32) = (1024, 8);

/// A pool of slots as the contention workload sees it.
trait Pool: Clone + Send + Sync + 'static {
    type Guard<'a>: Send
    where
        Self: 'a;
    fn take(&self) -> impl Future<Output = Self::Guard<'_>> + Send;
    fn give<'a>(guard: Self::Guard<'a>) -> impl Future<Output = ()> + Send + 'a;
}

impl Pool for Supervisor {
    type Guard<'a> = Lease;

    async fn take(&self) -> Lease {
        self.acquire().await.expect("acquire")
    }

    async fn give<'a>(mut lease: Self::Guard<'a>) {
        lease.release().await.expect("release");
    }
}

impl Pool for Owner {
    type Guard<'a> = (&'a Owner, usize);

    async fn take(&self) -> (&Owner, usize) {
        (self, self.acquire().await)
    }

    async fn give<'a>((owner, slot): Self::Guard<'a>) {
        owner.release(slot).await;
    }
}

impl Pool for Arc<Semaphore> {
    type Guard<'a> = SemaphorePermit<'a>;

    async fn take(&self) -> SemaphorePermit<'_> {
        self.acquire().await.expect("semaphore open")
    }

    fn give<'a>(permit: Self::Guard<'a>) -> impl Future<Output = ()> + Send + 'a {
        drop(permit);
        std::future::ready(())
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

async fn worker_loop<P: Pool>(
    pool: P,
    ops: u64,
    mut latency: Option<Histogram<u64>>,
) -> Option<Histogram<u64>> {
    match latency.as_mut() {
        None => {
            for _ in 0..ops {
                let guard = pool.take().await;
                tokio::task::yield_now().await;
                P::give(guard).await;
            }
        }
        Some(hist) => {
            for _ in 0..ops {
                let asked = Instant::now();
                let guard = pool.take().await;
                hist.saturating_record(asked.elapsed().as_nanos() as u64);
                tokio::task::yield_now().await;
                P::give(guard).await;
            }
        }
    }
    latency
}

/// `workers` tasks do `TOTAL_OPS` acquire + release between them. The clock starts when every
/// worker is spawned and released through a barrier, and stops when the last has been joined.
async fn contend<P: Pool>(
    pool: &P,
    workers: usize,
    latency: bool,
) -> (Duration, Option<Histogram<u64>>) {
    let per_worker = TOTAL_OPS / workers as u64;
    let barrier = Arc::new(Barrier::new(workers + 1));
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let pool = pool.clone();
            let barrier = Arc::clone(&barrier);
            let hist = latency.then(new_histogram);
            tokio::spawn(async move {
                barrier.wait().await;
                worker_loop(pool, per_worker, hist).await
            })
        })
        .collect();
    barrier.wait().await;
    let start = Instant::now();
    let mut outcomes = Vec::with_capacity(workers);
    for handle in handles {
        outcomes.push(handle.await.expect("worker panicked"));
    }
    let elapsed = start.elapsed();
    let merged = latency.then(|| {
        let mut all = new_histogram();
        for h in outcomes.into_iter().flatten() {
            all.add(h).expect("same bounds");
        }
        all
    });
    (elapsed, merged)
}

/// Wait percentiles (ns) of one contention pair, collected outside criterion's timing.
struct LatencyRow {
    workers: usize,
    slots: u32,
    leasehold: [u64; 3],
    shape: [u64; 3],
    semaphore: [u64; 3],
    /// Over leasehold's pass.
    counts: Counts,
    /// Over the shape floor's pass.
    owner: OwnerCounts,
}

static LATENCY: Mutex<Vec<LatencyRow>> = Mutex::new(Vec::new());

fn percentiles(h: &Histogram<u64>) -> [u64; 3] {
    [
        h.value_at_quantile(0.50),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
    ]
}

fn param(workers: usize, slots: u32) -> String {
    format!("workers={workers},slots={slots}")
}

fn contention(c: &mut Criterion) {
    let rt = floor::runtime();
    let mut group = c.benchmark_group(GROUP);
    group
        .sample_size(SAMPLES)
        .throughput(Throughput::Elements(TOTAL_OPS));
    floor::times(
        &mut group,
        Duration::from_millis(300),
        Duration::from_secs(2),
    );

    for workers in WORKERS {
        for slots in SLOTS {
            let sup = rt.block_on(start_supervisor(slots, None));
            let (owner, owner_join) = rt.block_on(Owner::start(slots as usize));
            let sem = Arc::new(Semaphore::new(slots as usize));
            let p = param(workers, slots);
            // Percentiles once per pair, on the first call (so that a filter that skips this
            // pair skips them too), untimed.
            let mut latency_done = false;

            let k = key(GROUP, "leasehold", &p);
            group.bench_function(BenchmarkId::new("leasehold", &p), |b| {
                if !latency_done {
                    latency_done = true;
                    let (sup, owner, sem) = (sup.clone(), owner.clone(), Arc::clone(&sem));
                    let (l, o, s, counts, owner_counts) = rt.block_on(async move {
                        tokio::spawn(async move {
                            let before = Counts::now();
                            let (_, l) = contend(&sup, workers, true).await;
                            let counts = Counts::now().since(before);
                            owner.take_counts();
                            let (_, o) = contend(&owner, workers, true).await;
                            let owner_counts = owner.take_counts();
                            let (_, s) = contend(&sem, workers, true).await;
                            (
                                l.expect("histogram"),
                                o.expect("histogram"),
                                s.expect("histogram"),
                                counts,
                                owner_counts,
                            )
                        })
                        .await
                        .expect("latency pass")
                    });
                    LATENCY.lock().expect("latency lock").push(LatencyRow {
                        workers,
                        slots,
                        leasehold: percentiles(&l),
                        shape: percentiles(&o),
                        semaphore: percentiles(&s),
                        counts,
                        owner: owner_counts,
                    });
                }
                timed(b, &rt, &k, SAMPLES, |iters| {
                    let sup = sup.clone();
                    async move {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            total += contend(&sup, workers, false).await.0;
                        }
                        total
                    }
                });
            });

            let k = key(GROUP, "shape_floor", &p);
            group.bench_function(BenchmarkId::new("shape_floor", &p), |b| {
                timed(b, &rt, &k, SAMPLES, |iters| {
                    let owner = owner.clone();
                    async move {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            total += contend(&owner, workers, false).await.0;
                        }
                        total
                    }
                });
            });

            let k = key(GROUP, "tokio_semaphore", &p);
            group.bench_function(BenchmarkId::new("tokio_semaphore", &p), |b| {
                timed(b, &rt, &k, SAMPLES, |iters| {
                    let sem = Arc::clone(&sem);
                    async move {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            total += contend(&sem, workers, false).await.0;
                        }
                        total
                    }
                });
            });

            rt.block_on(async {
                owner.close(owner_join).await;
                sup.shutdown().await.expect("shutdown");
            });
        }
    }
    group.finish();
}

fn row(workers: usize, slots: u32, target: Option<f64>) {
    row_against("tokio_semaphore", "tokio Semaphore", workers, slots, target);
}

/// One row of leasehold (or the shape floor, `of`) over `floor`, for one pair.
fn row_of(of: &str, floor: &str, label: &str, workers: usize, slots: u32, target: Option<f64>) {
    let p = param(workers, slots);
    let label = format!("{workers} workers / {slots} slots, {label}, per lease");
    let label = if target.is_some() {
        format!("**{label}**")
    } else {
        label
    };
    ratio_row(
        &label,
        &key(GROUP, of, &p),
        &key(GROUP, floor, &p),
        TOTAL_OPS,
        target,
    );
}

fn row_against(floor: &str, name: &str, workers: usize, slots: u32, target: Option<f64>) {
    row_of(
        "leasehold",
        floor,
        &format!("leasehold / {name}"),
        workers,
        slots,
        target,
    );
}

fn summary(_c: &mut Criterion) {
    if !table_start(
        "contention (yielding body), leasehold / the shape floor and / tokio Semaphore",
        &format!("per lease: one iteration's time over its {TOTAL_OPS} acquire + release"),
    ) {
        return;
    }
    let (tw, ts, target) = TARGET;
    row_against("shape_floor", "the shape floor", tw, ts, Some(TARGET_SHAPE));
    row(tw, ts, Some(target));
    row_against("shape_floor", "the shape floor", ALSO.0, ALSO.1, None);
    row(ALSO.0, ALSO.1, None);
    row_of(
        "shape_floor",
        "tokio_semaphore",
        "the shape floor / tokio Semaphore",
        tw,
        ts,
        None,
    );
    for workers in WORKERS {
        for slots in SLOTS {
            if (workers, slots) != (tw, ts) && (workers, slots) != ALSO {
                row(workers, slots, None);
            }
        }
    }

    let latency = LATENCY.lock().expect("latency lock");
    if !latency.is_empty() {
        println!();
        println!("### contention: per-acquire wait (one untimed pass per pair)");
        println!();
        println!(
            "| workers | slots | leasehold p50 / p99 / p99.9 | shape floor p50 / p99 / p99.9 | tokio Semaphore p50 / p99 / p99.9 |"
        );
        println!("|---|---|---|---|---|");
        for row in latency.iter() {
            let f = |p: [u64; 3]| {
                format!(
                    "{} / {} / {}",
                    fmt_ns(p[0] as f64),
                    fmt_ns(p[1] as f64),
                    fmt_ns(p[2] as f64)
                )
            };
            println!(
                "| {} | {} | {} | {} | {} |",
                row.workers,
                row.slots,
                f(row.leasehold),
                f(row.shape),
                f(row.semaphore)
            );
        }
        println!();
        println!("### contention: what noise does not move (the same untimed pass)");
        println!();
        println!(
            "| workers | slots | leasehold doorbells / lease | leasehold polls / lease | shape floor doorbells / lease | shape floor actor turns / lease | shape floor requests / turn |"
        );
        println!("|---|---|---|---|---|---|---|");
        for row in latency.iter() {
            let leases = (TOTAL_OPS / row.workers as u64 * row.workers as u64).max(1) as f64;
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                row.workers,
                row.slots,
                row.counts.rings as f64 / leases,
                row.counts.polls as f64 / leases,
                row.owner.rings as f64 / leases,
                row.owner.wakes as f64 / leases,
                row.owner.drained as f64 / row.owner.wakes.max(1) as f64
            );
        }
    }
    table_end();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = contention, summary
}
criterion_main!(benches);
