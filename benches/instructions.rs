//! A loop to count instructions in, not to time: the figures machine noise does not move.
//!
//! Run under callgrind twice, with N round trips and with none, and subtract (the command is in
//! `BENCHMARKS.md`):
//!
//! ```text
//! cargo bench --no-default-features --bench instructions --no-run
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null <the binary> lease 20000
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null <the binary> lease 0
//! ```
//!
//! Shapes: `lease` (one caller on a worker thread of a 2-worker runtime, acquire + release of an
//! explicit lease on 8 slots, as `benches/lease.rs`), `contention` (64 tasks on 8 slots, each
//! acquire, yield, release, as `benches/contention.rs`; the count is the total leases), `run`,
//! `submit` and `spawn_job` (one no-op job at a time, as `benches/run.rs`: `run`, `submit` and
//! its handle joined, `spawn_job` of an actor that stops in `post_start`), and the shape floor's
//! `owner_lease` and `owner_contention` (the same two workloads on one owner actor written by
//! hand, `floor/owner.rs`: the yardstick for a lease by message). The first 100 round
//! trips warm up in both runs, so they cancel out. Under plain `cargo bench` (or
//! `-- --test`) it runs each shape briefly and prints what it did.

mod floor;

use std::sync::Arc;

use leasehold::Supervisor;

use floor::{Owner, acquire_release, owner_acquire_release, runtime};

/// One contended round on a pool: acquire, yield, release.
trait Round: Clone + Send + Sync + 'static {
    fn round(&self) -> impl std::future::Future<Output = ()> + Send;
}

impl Round for Supervisor {
    async fn round(&self) {
        let mut lease = self.acquire().await.expect("acquire");
        tokio::task::yield_now().await;
        lease.release().await.expect("release");
    }
}

impl Round for Owner {
    async fn round(&self) {
        let slot = self.acquire().await;
        tokio::task::yield_now().await;
        self.release(slot).await;
    }
}

/// 64 tasks on 8 slots, `n` rounds between them, as `benches/contention.rs` spreads its leases.
async fn contention<P: Round>(pool: &P, n: u64) {
    let workers = 64u64;
    let mut tasks = Vec::new();
    for w in 0..workers {
        let pool = pool.clone();
        let share = n / workers + u64::from(w < n % workers);
        tasks.push(tokio::spawn(async move {
            for _ in 0..share {
                pool.round().await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
}

/// A shape of the shape floor, as `run` runs leasehold's.
fn run_owner(shape: &str, n: u64) {
    let rt = Arc::new(runtime());
    let shape = shape.to_owned();
    rt.clone().block_on(async move {
        tokio::spawn(async move {
            let (owner, join) = Owner::start(8).await;
            for n in [100, n] {
                match shape.as_str() {
                    "owner_lease" => owner_acquire_release(&owner, n).await,
                    "owner_contention" => contention(&owner, n).await,
                    other => panic!("unknown shape {other:?} (owner_lease, owner_contention)"),
                }
            }
            owner.close(join).await;
        })
        .await
        .expect("the loop");
    });
}

fn run(shape: &str, n: u64) {
    if shape.starts_with("owner_") {
        return run_owner(shape, n);
    }
    let rt = Arc::new(runtime());
    let shape = shape.to_owned();
    rt.clone().block_on(async move {
        // On a worker thread, as the benches' callers are.
        tokio::spawn(async move {
            let sup = Supervisor::builder().slots(8).start().await.expect("start");
            match shape.as_str() {
                "lease" => {
                    acquire_release(&sup, 100).await;
                    acquire_release(&sup, n).await;
                }
                "contention" => {
                    contention(&sup, 100).await;
                    contention(&sup, n).await;
                }
                "run" | "submit" | "spawn_job" => {
                    for n in [100, n] {
                        for _ in 0..n {
                            match shape.as_str() {
                                "run" => floor::noop_run(&sup).await,
                                "submit" => floor::noop_submit(&sup).await,
                                _ => floor::noop_spawn_job(&sup).await,
                            }
                        }
                    }
                }
                other => {
                    panic!(
                        "unknown shape {other:?} (lease, contention, run, submit, spawn_job, owner_lease, owner_contention)"
                    )
                }
            }
            sup.shutdown().await.expect("shutdown");
        })
        .await
        .expect("the loop");
    });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [shape, n] if !shape.starts_with('-') => run(shape, n.parse().expect("a count")),
        // `cargo bench` / `cargo bench -- --test`: a brief run of each shape.
        _ => {
            for shape in [
                "lease",
                "contention",
                "run",
                "submit",
                "spawn_job",
                "owner_lease",
                "owner_contention",
            ] {
                run(shape, 256);
                println!(
                    "instructions: {shape} ran 256 round trips (count them under callgrind: see BENCHMARKS.md)"
                );
            }
        }
    }
}
