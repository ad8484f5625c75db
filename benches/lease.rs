//! Lease round trip: `acquire` + `release` of an explicit lease, uncontended (8 slots, one
//! caller), next to its floors measured in the same run (see `BENCHMARKS.md`):
//!
//! - `tokio_semaphore`: a tokio `Semaphore` permit acquired and dropped;
//! - `mpsc_oneshot`: a tokio mpsc + oneshot round trip to a task;
//! - `ractor_call`: one raw ractor `call` to an actor that answers at once: the target's floor,
//!   acquire + release ≤ 2.2× of it;
//! - `ractor_call_x2`: two raw calls in a row, context (acquire and release are each a message
//!   to the supervisor actor).
//! - `leasehold_console_sse` (feature `console`): the same acquire + release on a supervisor
//!   whose web console runs with one browser-like client reading its event stream (from its
//!   own thread, as a browser would be its own process): the console's cost, target within
//!   5 % of `leasehold`. The console and its client exist only while it is
//!   measured, so the other figures are taken without them.
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
    PingActor, acquire_release, key, ratio_row, start_supervisor, table_end, table_start, timed,
};

const GROUP: &str = "lease_round_trip";
const SAMPLES: usize = 30;
const PARAM: &str = "slots=8";
/// acquire + release ≤ 2.2× one raw ractor call.
const TARGET_ONE_CALL: f64 = 2.2;
/// With the web console and one event-stream client, within 5 % of without.
const TARGET_CONSOLE: f64 = 1.05;

fn lease_round_trip(c: &mut Criterion) {
    let rt = floor::runtime();
    let sup = rt.block_on(start_supervisor(8, None));
    let sem = Arc::new(Semaphore::new(8));
    let (ping, ping_join) = rt
        .block_on(Actor::spawn(None, PingActor, ()))
        .expect("ping actor starts");
    let echo = floor::spawn_echo(&rt);

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

    // The web console's cost: a supervisor of its own, its console and one client reading the
    // event stream, alive only for this measurement.
    #[cfg(feature = "console")]
    {
        let sup = rt.block_on(start_supervisor(8, None));
        let console = rt
            .block_on(leasehold::console::Console::builder(sup.clone()).start())
            .expect("console starts");
        let client = sse::Client::connect(console.local_addr());
        let k = key(GROUP, "leasehold_console_sse", PARAM);
        group.bench_function(BenchmarkId::new("leasehold_console_sse", PARAM), |b| {
            timed(b, &rt, &k, SAMPLES, |iters| {
                let sup = sup.clone();
                async move {
                    let start = Instant::now();
                    acquire_release(&sup, iters).await;
                    start.elapsed()
                }
            });
        });
        rt.block_on(async {
            console.shutdown().await.expect("console stops");
            sup.shutdown().await.expect("shutdown");
        });
        client.join();
    }

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

    drop(echo);
    rt.block_on(async {
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
        "**acquire+release, web console + 1 SSE client / without console**",
        &k("leasehold_console_sse"),
        &k("leasehold"),
        1,
        Some(TARGET_CONSOLE),
    );
    #[cfg(feature = "console")]
    println!(
        "\n(the console row's client read {} frames while it was measured)",
        sse::FRAMES.load(std::sync::atomic::Ordering::Relaxed)
    );
    #[cfg(not(feature = "console"))]
    println!("\n(the console row needs `--features console`)");
    table_end();
}

/// A browser stand-in: one thread that reads the console's event stream until it ends.
#[cfg(feature = "console")]
mod sse {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::thread::JoinHandle;

    /// Frames read, over every client.
    pub static FRAMES: AtomicU64 = AtomicU64::new(0);

    pub struct Client(JoinHandle<()>);

    impl Client {
        /// Connects and reads on a thread of its own; the first frame has arrived when this
        /// returns.
        pub fn connect(addr: SocketAddr) -> Client {
            let mut stream = TcpStream::connect(addr).expect("console reachable");
            write!(
                stream,
                "GET /api/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n"
            )
            .expect("request sent");
            let (first_tx, first_rx) = std::sync::mpsc::channel();
            let thread = std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                let mut first = Some(first_tx);
                // Until the console closes the stream.
                while let Ok(n @ 1..) = stream.read(&mut buf) {
                    let frames = buf[..n].windows(6).filter(|w| w == b"data: ").count();
                    FRAMES.fetch_add(frames as u64, Ordering::Relaxed);
                    if frames > 0
                        && let Some(tx) = first.take()
                    {
                        let _ = tx.send(());
                    }
                }
            });
            first_rx.recv().expect("a first frame");
            Client(thread)
        }

        pub fn join(self) {
            self.0.join().expect("client thread");
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = lease_round_trip, summary
}
criterion_main!(benches);
