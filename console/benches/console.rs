//! The web console's cost: `acquire` + `release` of an explicit lease, uncontended (8 slots, one
//! caller), on a supervisor whose console runs with one browser-like client reading its event
//! stream (from its own thread, as a browser would be its own process), and on one whose page is
//! open in headless Chromium, next to the same on a supervisor without a console, measured in
//! the same run (see the repository's `BENCHMARKS.md`). Target: within 5 %. Without Chromium
//! the browser row is skipped, loudly (a failure under `CI` or `LEASEHOLD_REQUIRE_BROWSER=1`).
//!
//! criterion ids are `console_cost/<function>/slots=8`. The last "benchmark", `summary`, prints
//! the ratio row from the samples criterion took above. `-- --test` runs each once.

#[path = "../../benches/floor/mod.rs"]
mod floor;

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use leasehold::Supervisor;
use tokio::runtime::Runtime;

use floor::{acquire_release, key, ratio_row, start_supervisor, table_end, table_start, timed};

const GROUP: &str = "console_cost";
const SAMPLES: usize = 30;
const PARAM: &str = "slots=8";
/// With the web console and one event-stream client, within 5 % of without.
const TARGET_CONSOLE: f64 = 1.05;

/// Times acquire + release on `sup` under `function`.
fn round_trip(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &Runtime,
    sup: &Supervisor,
    function: &str,
) {
    let k = key(GROUP, function, PARAM);
    group.bench_function(BenchmarkId::new(function, PARAM), |b| {
        timed(b, rt, &k, SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let start = Instant::now();
                acquire_release(&sup, iters).await;
                start.elapsed()
            }
        });
    });
}

fn console_cost(c: &mut Criterion) {
    let rt = floor::runtime();
    let mut group = c.benchmark_group(GROUP);
    group
        .sample_size(SAMPLES)
        .throughput(Throughput::Elements(1));
    floor::times(
        &mut group,
        Duration::from_millis(500),
        Duration::from_secs(2),
    );

    let sup = rt.block_on(start_supervisor(8, None));
    round_trip(&mut group, &rt, &sup, "leasehold");
    rt.block_on(async { sup.shutdown().await.expect("shutdown") });

    // A supervisor of its own, its console and one client reading the event stream, alive only
    // for this measurement.
    let sup = rt.block_on(start_supervisor(8, None));
    let console = rt
        .block_on(leasehold_console::Console::builder(sup.clone()).start())
        .expect("console starts");
    let client = sse::Client::connect(console.local_addr());
    round_trip(&mut group, &rt, &sup, "leasehold_console_sse");
    rt.block_on(async {
        console.shutdown().await.expect("console stops");
        sup.shutdown().await.expect("shutdown");
    });
    client.join();

    // The same with the page open in headless Chromium (its tab renders every frame, asks for
    // the timeline and the history): what a developer's browser costs the supervisor.
    if let Some(exe) = browser::chromium() {
        // Context: the same browser with a blank tab and no console, what Chromium's own
        // processes cost the machine (on 2 cores they share the CPU with the supervisor).
        let sup = rt.block_on(start_supervisor(8, None));
        let tab = rt.block_on(browser::Tab::open(&exe, "about:blank"));
        round_trip(&mut group, &rt, &sup, "leasehold_blank_tab");
        rt.block_on(tab.close());
        rt.block_on(async { sup.shutdown().await.expect("shutdown") });

        let sup = rt.block_on(start_supervisor(8, None));
        let console = rt
            .block_on(leasehold_console::Console::builder(sup.clone()).start())
            .expect("console starts");
        let tab = rt.block_on(browser::Tab::open(&exe, console.url()));
        round_trip(&mut group, &rt, &sup, "leasehold_console_browser");
        let frames = rt.block_on(tab.close());
        println!("(the browser tab rendered {frames} frames while it was measured)");
        rt.block_on(async {
            console.shutdown().await.expect("console stops");
            sup.shutdown().await.expect("shutdown");
        });
    }
    group.finish();
}

fn summary(_c: &mut Criterion) {
    if !table_start("the web console's cost", "per acquire + release") {
        return;
    }
    let k = |f: &str| key(GROUP, f, PARAM);
    ratio_row(
        "**acquire+release, web console + 1 SSE client / without console**",
        &k("leasehold_console_sse"),
        &k("leasehold"),
        1,
        Some(TARGET_CONSOLE),
    );
    ratio_row(
        "**acquire+release, web console + 1 browser tab / without console**",
        &k("leasehold_console_browser"),
        &k("leasehold"),
        1,
        Some(TARGET_CONSOLE),
    );
    ratio_row(
        "acquire+release, a blank browser tab, no console / without either (context)",
        &k("leasehold_blank_tab"),
        &k("leasehold"),
        1,
        None,
    );
    ratio_row(
        "acquire+release, web console + 1 browser tab / a blank browser tab (context)",
        &k("leasehold_console_browser"),
        &k("leasehold_blank_tab"),
        1,
        None,
    );
    println!(
        "\n(the console row's client read {} frames while it was measured)",
        sse::FRAMES.load(std::sync::atomic::Ordering::Relaxed)
    );
    table_end();
}

/// A real browser: headless Chromium (Debian's `chromium`) with the console's page open.
mod browser {
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use chromiumoxide::browser::{Browser, BrowserConfig};
    use futures_util::StreamExt;

    /// Chromium, or a loud skip (a panic under `LEASEHOLD_REQUIRE_BROWSER=1` or `CI`).
    pub fn chromium() -> Option<PathBuf> {
        let found = std::env::var_os("LEASEHOLD_CHROMIUM")
            .map(PathBuf::from)
            .or_else(|| {
                ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
                    .into_iter()
                    .map(PathBuf::from)
                    .find(|p| p.exists())
            });
        if found.is_none() {
            let required = std::env::var_os("CI").is_some_and(|v| !v.is_empty())
                || std::env::var("LEASEHOLD_REQUIRE_BROWSER").as_deref() == Ok("1");
            assert!(
                !required,
                "no chromium, and CI or LEASEHOLD_REQUIRE_BROWSER=1 requires it"
            );
            eprintln!(
                "\n*** SKIPPED the browser-tab row: no chromium (apt-get install chromium) ***\n"
            );
        }
        found
    }

    pub struct Tab {
        browser: Browser,
        page: chromiumoxide::Page,
        devtools: tokio::task::JoinHandle<()>,
        _profile: tempfile::TempDir,
    }

    impl Tab {
        /// Opens `url` and waits until the page shows live frames.
        pub async fn open(exe: &Path, url: &str) -> Tab {
            let profile = tempfile::tempdir().expect("a profile dir");
            let config = BrowserConfig::builder()
                .chrome_executable(exe)
                .disable_default_args()
                .no_sandbox()
                .user_data_dir(profile.path())
                .args([
                    "disable-gpu",
                    "no-first-run",
                    "disable-background-networking",
                    "disable-dev-shm-usage",
                ])
                .launch_timeout(Duration::from_secs(60))
                .build()
                .expect("browser config");
            let (browser, mut handler) = Browser::launch(config).await.expect("chromium starts");
            let devtools = tokio::spawn(async move {
                while let Some(event) = handler.next().await {
                    if event.is_err() {
                        break;
                    }
                }
            });
            let page = browser.new_page(url).await.expect("the console's page");
            // The console's page: until it shows live frames.
            for _ in 0..200 {
                if url == "about:blank" {
                    break;
                }
                let frames: f64 = page
                    .evaluate_expression("(window.consoleFrames || 0)")
                    .await
                    .expect("evaluate")
                    .into_value()
                    .expect("a number");
                if frames >= 3.0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Tab {
                browser,
                page,
                devtools,
                _profile: profile,
            }
        }

        /// Closes the browser; the frames the page rendered.
        pub async fn close(mut self) -> u64 {
            let frames: f64 = self
                .page
                .evaluate_expression("(window.consoleFrames || 0)")
                .await
                .expect("evaluate")
                .into_value()
                .expect("a number");
            self.browser.close().await.expect("close");
            let _ = self.browser.wait().await;
            let _ = self.devtools.await;
            frames as u64
        }
    }
}

/// A browser stand-in: one thread that reads the console's event stream until it ends.
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
    targets = console_cost, summary
}
criterion_main!(benches);
