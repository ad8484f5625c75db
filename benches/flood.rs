//! Flood: 100 000 concurrent `Supervisor::run` calls with a no-op body on 8 slots, next to
//! 100 000 hand-written jobs (a tokio task each: permit, temp dir, spawn + join, remove) in the
//! same run (see `BENCHMARKS.md`).
//!
//! The timed benchmark is one whole flood per iteration (flat sampling). Before it, an untimed
//! probe with the counting allocator below gives the bytes each waiting job costs (target ≤ 1 KiB
//! per waiting job) and asserts no leak: the supervisor's books balance after
//! every flood, a second flood leaves nothing more behind than the first, and the heap is back
//! at its baseline once the supervisor has stopped. Whether a *live* supervisor's heap is back
//! near its baseline after the drain ("nothing left after the drain") is printed with its
//! verdict; `LEASEHOLD_BENCH_STRICT_RESIDUAL=1` also asserts it.
//!
//! criterion ids are `flood/<leasehold_run|hand_written>/jobs=100000,slots=8`. The last
//! "benchmark", `summary`, prints the rows. `-- --test` runs the probe and one flood of each.

mod floor;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use leasehold::Supervisor;
use tokio::sync::Semaphore;

use floor::{
    fmt_ns, hand_written_task_job, key, noop_run, ratio_row, start_supervisor, table_end,
    table_start, timed,
};

// ---------------------------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------------------------

/// Counts live heap bytes while [`TRACKING`] is on (the memory probe only). Outside that window
/// each allocation pays one relaxed load, so the timed floods are not slowed by a contended
/// counter. A `#[global_allocator]` is per binary: only this bench has it. Counts are signed and relative: a block allocated before the window and freed inside
/// it lowers the count, which is right for "how much did the live heap change since the
/// baseline".
struct CountingAlloc;

static TRACKING: AtomicBool = AtomicBool::new(false);
static CURRENT: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn count(delta: isize) {
    // Relaxed: the counters publish no other memory; the flood reads them after joining every
    // task that allocated, so the join's own synchronisation orders the reads.
    if TRACKING.load(Ordering::Relaxed) {
        let now = CURRENT.fetch_add(delta, Ordering::Relaxed) + delta;
        if delta > 0 && now > PEAK.load(Ordering::Relaxed) {
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
    }
}

// SAFETY: every method forwards to `System` unchanged and only adds bookkeeping on atomics,
// which never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Live bytes (relative) now.
fn live_bytes() -> isize {
    CURRENT.load(Ordering::Relaxed)
}

/// Starts a tracking window: the peak restarts from the current count.
fn track(on: bool) {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    TRACKING.store(on, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------
// The flood
// ---------------------------------------------------------------------------------------------

const FLOOD: &str = "flood";
const FLOOD_SAMPLES: usize = 10;
const FLOOD_JOBS: usize = 100_000;
const FLOOD_SLOTS: u32 = 8;
/// What may stay allocated without counting as growth: runtime and allocator bookkeeping that
/// does not scale with the number of jobs (blocking-pool threads, timer wheels, channel
/// blocks). A leak of even 8 bytes per job would be 800 KB.
const FLOOD_RESIDUAL_SLACK: isize = 256 * 1024;
/// Set to 1 to also require that a *live* supervisor's heap is back near its pre-flood baseline
/// after the drain (it gives its maps' memory back once a flood has drained; see BENCHMARKS.md).
const STRICT_RESIDUAL_ENV: &str = "LEASEHOLD_BENCH_STRICT_RESIDUAL";

/// Times of one flood.
#[derive(Clone, Copy, Default)]
struct FloodRun {
    /// Spawning every caller until every one is queued behind the held slots.
    queue: Duration,
    /// From letting the slots go until the last job has returned.
    drain: Duration,
    total: Duration,
}

/// Live heap over the baseline taken at the start of one flood (meaningful only while the
/// counting allocator is tracking).
#[derive(Clone, Copy, Default)]
struct FloodBytes {
    /// With every job queued.
    queued: isize,
    /// The highest point.
    peak: isize,
    /// After the drain: every caller joined, the supervisor (if any) still alive.
    residual: isize,
}

/// The untimed memory probe's figures.
#[derive(Clone, Copy)]
struct FloodMemory {
    /// `size_of_val` of one caller's future (what each spawned task stores inline).
    caller_future: usize,
    run: FloodRun,
    bytes: FloodBytes,
    /// Leasehold only: what a second flood on the same supervisor left over the first.
    growth_second_flood: Option<isize>,
    /// Leasehold only: live heap after the supervisor shut down, over the first baseline.
    after_shutdown: Option<isize>,
}

static FLOOD_MEMORY: Mutex<BTreeMap<&'static str, FloodMemory>> = Mutex::new(BTreeMap::new());

/// Restarts the peak at the current count and returns that count.
fn baseline() -> isize {
    let now = live_bytes();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// Waits (sleeping briefly, bounded) until `ready` holds.
async fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "flood: timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// `run` answers before the actor publishes its stats for that message: waits until they show
/// an idle supervisor.
async fn settle(sup: &Supervisor) {
    let idle = || {
        let s = sup.stats();
        s.active == 0
            && s.waiting == 0
            && s.acquired_total == s.released_total + s.release_failed_total
    };
    wait_until("the stats settle", idle).await;
}

async fn leasehold_caller(sup: Supervisor) {
    noop_run(&sup).await;
}

async fn hand_written_caller(sem: Arc<Semaphore>, root: Arc<PathBuf>, asking: Arc<AtomicUsize>) {
    asking.fetch_add(1, Ordering::Relaxed);
    hand_written_task_job(&sem, &root).await;
}

/// 100 000 `run` calls queue behind the supervisor's slots, held as explicit leases so that
/// every job is provably waiting when the memory is read; then the slots go and the flood
/// drains. Asserts that nothing leaked in the supervisor's books.
async fn flood_leasehold(sup: &Supervisor) -> (FloodRun, FloodBytes) {
    settle(sup).await;
    let before = sup.stats();
    let mut gates = Vec::with_capacity(FLOOD_SLOTS as usize);
    for _ in 0..FLOOD_SLOTS {
        gates.push(sup.acquire().await.expect("gate acquire"));
    }
    let mut callers = Vec::with_capacity(FLOOD_JOBS);
    let base = baseline();
    let start = Instant::now();
    for _ in 0..FLOOD_JOBS {
        callers.push(tokio::spawn(leasehold_caller(sup.clone())));
    }
    wait_until("every job is queued", || sup.stats().waiting == FLOOD_JOBS).await;
    let queue = start.elapsed();
    let queued = live_bytes() - base;
    let drain_start = Instant::now();
    for gate in &mut gates {
        gate.release().await.expect("gate release");
    }
    for caller in callers.drain(..) {
        caller.await.expect("caller task");
    }
    let drain = drain_start.elapsed();
    let total = start.elapsed();
    settle(sup).await;
    let stats = sup.stats();
    assert_eq!(
        stats.active, 0,
        "flood: no lease may stay active: {stats:?}"
    );
    assert_eq!(stats.waiting, 0, "flood: nobody may still wait: {stats:?}");
    assert_eq!(
        stats.acquired_total, stats.released_total,
        "flood: every grant released: {stats:?}"
    );
    assert_eq!(
        stats.release_failed_total, 0,
        "flood: no release failed: {stats:?}"
    );
    assert_eq!(
        stats.acquired_total - before.acquired_total,
        (FLOOD_JOBS + FLOOD_SLOTS as usize) as u64,
        "flood: one grant per job and per gate: {stats:?}"
    );
    let residual = live_bytes() - base;
    let peak = PEAK.load(Ordering::Relaxed) - base;
    (
        FloodRun {
            queue,
            drain,
            total,
        },
        FloodBytes {
            queued,
            peak,
            residual,
        },
    )
}

/// The same flood, hand-written: 100 000 tasks wait on a semaphore whose permits are held.
async fn flood_hand_written(root: &Arc<PathBuf>) -> (FloodRun, FloodBytes) {
    let sem = Arc::new(Semaphore::new(FLOOD_SLOTS as usize));
    let gates = Arc::clone(&sem)
        .acquire_many_owned(FLOOD_SLOTS)
        .await
        .expect("gate permits");
    let asking = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::with_capacity(FLOOD_JOBS);
    let base = baseline();
    let start = Instant::now();
    for _ in 0..FLOOD_JOBS {
        let caller = hand_written_caller(Arc::clone(&sem), Arc::clone(root), Arc::clone(&asking));
        callers.push(tokio::spawn(caller));
    }
    wait_until("every job is queued", || {
        asking.load(Ordering::Relaxed) == FLOOD_JOBS
    })
    .await;
    // The counter is bumped in the same poll that queues the acquire; one more tick settles it.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let queue = start.elapsed();
    let queued = live_bytes() - base;
    let drain_start = Instant::now();
    drop(gates);
    for caller in callers.drain(..) {
        caller.await.expect("caller task");
    }
    let drain = drain_start.elapsed();
    let total = start.elapsed();
    let residual = live_bytes() - base;
    let peak = PEAK.load(Ordering::Relaxed) - base;
    (
        FloodRun {
            queue,
            drain,
            total,
        },
        FloodBytes {
            queued,
            peak,
            residual,
        },
    )
}

async fn warm(sup: &Supervisor) {
    // Blocking-pool threads, lazily built statics: one-time allocations not charged to a flood.
    for _ in 0..64 {
        noop_run(sup).await;
    }
}

/// The memory probe, untimed, with the counting allocator on: two floods on one fresh
/// supervisor, then its shutdown.
async fn probe_leasehold(root: PathBuf) -> FloodMemory {
    let sup = start_supervisor(FLOOD_SLOTS, Some(&root)).await;
    warm(&sup).await;
    let caller_future = std::mem::size_of_val(&leasehold_caller(sup.clone()));
    track(true);
    let first_base = live_bytes();
    let (run, bytes) = flood_leasehold(&sup).await;
    let after_first = live_bytes();
    flood_leasehold(&sup).await;
    let growth = live_bytes() - after_first;
    sup.shutdown().await.expect("shutdown");
    drop(sup);
    let after_shutdown = live_bytes() - first_base;
    track(false);
    assert!(
        growth <= FLOOD_RESIDUAL_SLACK,
        "flood: a second flood left {growth} more bytes than the first (slack {FLOOD_RESIDUAL_SLACK}): a leak"
    );
    assert!(
        after_shutdown <= FLOOD_RESIDUAL_SLACK,
        "flood: {after_shutdown} bytes still allocated after the supervisor stopped (slack {FLOOD_RESIDUAL_SLACK})"
    );
    if std::env::var_os(STRICT_RESIDUAL_ENV).is_some_and(|v| v == "1") {
        assert!(
            bytes.residual <= FLOOD_RESIDUAL_SLACK,
            "flood: a live supervisor kept {} bytes after the drain (slack {FLOOD_RESIDUAL_SLACK})",
            bytes.residual
        );
    }
    FloodMemory {
        caller_future,
        run,
        bytes,
        growth_second_flood: Some(growth),
        after_shutdown: Some(after_shutdown),
    }
}

async fn probe_hand_written(root: Arc<PathBuf>) -> FloodMemory {
    let caller_future = std::mem::size_of_val(&hand_written_caller(
        Arc::new(Semaphore::new(1)),
        Arc::clone(&root),
        Arc::new(AtomicUsize::new(0)),
    ));
    track(true);
    let (run, bytes) = flood_hand_written(&root).await;
    track(false);
    assert!(
        bytes.residual <= FLOOD_RESIDUAL_SLACK,
        "flood (hand-written): {} bytes still allocated after the drain",
        bytes.residual
    );
    FloodMemory {
        caller_future,
        run,
        bytes,
        growth_second_flood: None,
        after_shutdown: None,
    }
}

fn flood(c: &mut Criterion) {
    let rt = floor::runtime();
    let scratch = floor::scratch_dir();
    let sup_root = scratch.path().join("leasehold");
    let probe_root = scratch.path().join("probe");
    let hand_root = Arc::new(scratch.path().join("hand"));
    std::fs::create_dir_all(&*hand_root).expect("hand-written root");
    let sup = rt.block_on(start_supervisor(FLOOD_SLOTS, Some(&sup_root)));
    rt.block_on(warm(&sup));

    let mut group = c.benchmark_group(FLOOD);
    // One iteration is one whole flood: flat sampling, the fewest samples criterion allows.
    group
        .sample_size(FLOOD_SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(FLOOD_JOBS as u64));
    let p = format!("jobs={FLOOD_JOBS},slots={FLOOD_SLOTS}");

    let k = key(FLOOD, "leasehold_run", &p);
    // The memory probe runs on the first call, untimed (so a filter that skips this benchmark
    // skips it too).
    let mut probed = false;
    group.bench_function(BenchmarkId::new("leasehold_run", &p), |b| {
        if !probed {
            probed = true;
            let root = probe_root.clone();
            let memory = rt.block_on(rt.spawn(probe_leasehold(root))).expect("probe");
            FLOOD_MEMORY
                .lock()
                .expect("flood lock")
                .insert("leasehold_run", memory);
        }
        timed(b, &rt, &k, FLOOD_SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += flood_leasehold(&sup).await.0.total;
                }
                total
            }
        });
    });

    let k = key(FLOOD, "hand_written", &p);
    let mut probed = false;
    group.bench_function(BenchmarkId::new("hand_written", &p), |b| {
        if !probed {
            probed = true;
            let memory = rt
                .block_on(rt.spawn(probe_hand_written(Arc::clone(&hand_root))))
                .expect("probe");
            FLOOD_MEMORY
                .lock()
                .expect("flood lock")
                .insert("hand_written", memory);
        }
        timed(b, &rt, &k, FLOOD_SAMPLES, |iters| {
            let root = Arc::clone(&hand_root);
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += flood_hand_written(&root).await.0.total;
                }
                total
            }
        });
    });
    group.finish();

    rt.block_on(sup.shutdown()).expect("shutdown");
}

// ---------------------------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------------------------

/// ≤ 1 KiB per waiting job.
const TARGET_BYTES_PER_JOB: f64 = 1024.0;

fn summary(_c: &mut Criterion) {
    let p = format!("jobs={FLOOD_JOBS},slots={FLOOD_SLOTS}");
    if !table_start(
        &format!("flood ({FLOOD_JOBS} jobs on {FLOOD_SLOTS} slots)"),
        "per flood",
    ) {
        return;
    }
    ratio_row(
        &format!("flood total time, {FLOOD_JOBS} jobs"),
        &key(FLOOD, "leasehold_run", &p),
        &key(FLOOD, "hand_written", &p),
        1,
        None,
    );

    let floods = FLOOD_MEMORY.lock().expect("flood lock");
    if !floods.is_empty() {
        println!();
        println!(
            "### flood: {FLOOD_JOBS} concurrent jobs on {FLOOD_SLOTS} slots (untimed memory probe)"
        );
        println!();
        println!(
            "| | queue | drain | caller future | bytes per waiting job | peak per job | residual after drain | 2nd flood growth | after shutdown |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        let opt = |v: Option<isize>| v.map_or_else(|| "-".to_owned(), |v| format!("{v} B"));
        for (name, m) in floods.iter() {
            println!(
                "| {name} | {} | {} | {} B | {:.0} B | {:.0} B | {} B | {} | {} |",
                fmt_ns(m.run.queue.as_nanos() as f64),
                fmt_ns(m.run.drain.as_nanos() as f64),
                m.caller_future,
                m.bytes.queued as f64 / FLOOD_JOBS as f64,
                m.bytes.peak as f64 / FLOOD_JOBS as f64,
                m.bytes.residual,
                opt(m.growth_second_flood),
                opt(m.after_shutdown),
            );
        }
        if let (Some(l), Some(h)) = (floods.get("leasehold_run"), floods.get("hand_written")) {
            let per = |m: &FloodMemory| m.bytes.queued as f64 / FLOOD_JOBS as f64;
            let verdict = if per(l) <= TARGET_BYTES_PER_JOB {
                "met"
            } else {
                "MISSED"
            };
            // A spawned task stores its future inline; what the hand-written task costs beyond its
            // future is the runtime's per-task overhead, the same for both.
            let task_overhead = per(h) - h.caller_future as f64;
            let supervisor_side = per(l) - l.caller_future as f64 - task_overhead;
            println!();
            println!(
                "flood memory: {:.0} B per waiting job (hand-written {:.0} B, {:.2}×); target ≤ 1 KiB: {verdict}",
                per(l),
                per(h),
                per(l) / per(h)
            );
            println!(
                "  of which: caller future {} B, tokio task overhead ≈ {task_overhead:.0} B, supervisor side ≈ {supervisor_side:.0} B",
                l.caller_future
            );
            let residual_verdict = if l.bytes.residual <= FLOOD_RESIDUAL_SLACK {
                "met"
            } else {
                "MISSED"
            };
            println!(
                "flood residual with the supervisor alive: {} B ({:.0} B per job of the flood); target: nothing left after the drain (≤ {} KiB of fixed runtime bookkeeping): {residual_verdict}",
                l.bytes.residual,
                l.bytes.residual as f64 / FLOOD_JOBS as f64,
                FLOOD_RESIDUAL_SLACK / 1024
            );
        }
    }
    table_end();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = flood, summary
}
criterion_main!(benches);
