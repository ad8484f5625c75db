//! Serving the `render_slot.*` metrics to Prometheus while jobs run.
//!
//! Installs `metrics-exporter-prometheus` with its HTTP listener, starts a supervisor with two
//! slots and runs twelve short jobs against them, so that most of them wait. While they run, it
//! scrapes its own endpoint once and prints the `render_slot` lines; after the last job it
//! scrapes again and checks the totals. Prometheus names replace `.` with `_`:
//! `render_slot.acquire.count` is served as `render_slot_acquire_count`.
//!
//! ```sh
//! cargo run --example metrics_exporter
//! LEASEHOLD_METRICS_ADDR=127.0.0.1:9900 cargo run --example metrics_exporter
//! ```
//!
//! The example scrapes itself and exits. A real engine would keep the listener for the
//! process's whole life and point Prometheus at it (a `scrape_configs` target of this address).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use leasehold::{JobSpec, Supervisor};
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Where the listener binds when `LEASEHOLD_METRICS_ADDR` is not set.
const DEFAULT_ADDR: &str = "127.0.0.1:9898";
const JOBS: u64 = 12;
const SLOTS: u32 = 2;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::var("LEASEHOLD_METRICS_ADDR")
        .unwrap_or_else(|_| DEFAULT_ADDR.to_owned())
        .parse()?;

    // Before `start()`: the supervisor registers its metric handles when it starts, and handles
    // registered while no recorder is installed go nowhere. Inside the runtime, `install` binds
    // the listener now (a taken port fails here) and serves it on this runtime.
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()?;
    println!("serving metrics on http://{addr}/metrics");

    let sup = Supervisor::builder().slots(SLOTS).start().await?;

    // All jobs at once on two slots: two run, the rest queue, so the waiting gauge moves too.
    let mut jobs = Vec::new();
    for i in 0..JOBS {
        let sup = sup.clone();
        let job = JobSpec::new(format!("frame-{i}"))?;
        jobs.push(tokio::spawn(async move {
            sup.run(job, |ctx| async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                Ok::<_, io::Error>(ctx.slot_id())
            })
            .await
        }));
    }

    // Scrape once both slots are held and others queue: what Prometheus would see mid-run.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let stats = sup.stats();
        if stats.active == SLOTS as usize && stats.waiting > 0 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("the slots never filled up: {stats:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let during = scrape(addr).await?;
    println!("-- scrape while jobs run --");
    print_render_slot_lines(&during);
    // Presence, not values: jobs keep ending between the check above and the scrape.
    for name in ["render_slot_acquire_count", "render_slot_active_count"] {
        sample(&during, name).ok_or_else(|| format!("{name} missing from the scrape"))?;
    }

    for job in jobs {
        let slot = job.await??;
        assert!(slot < SLOTS, "slot {slot} out of range");
    }

    // Every `run` has returned, and the supervisor sets its gauges before it answers: the values
    // are exact now.
    let after = scrape(addr).await?;
    println!("-- scrape after the last job --");
    print_render_slot_lines(&after);
    let expected = [
        ("render_slot_acquire_count", JOBS as f64),
        ("render_slot_release_count", JOBS as f64),
        ("render_slot_active_count", 0.0),
        ("render_slot_waiting_count", 0.0),
    ];
    for (name, want) in expected {
        let got = sample(&after, name);
        if got != Some(want) {
            return Err(format!("{name}: expected {want}, scraped {got:?}").into());
        }
    }

    let report = sup.shutdown().await?;
    println!("stats:    {:?}", sup.stats());
    println!("shutdown: {report:?}");
    Ok(())
}

/// One scrape, as Prometheus would make it: HTTP/1.0, so the server closes the connection after
/// the response and reading to the end is the whole of it.
async fn scrape(addr: SocketAddr) -> Result<String, Box<dyn std::error::Error>> {
    let request = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok::<_, io::Error>(response)
    };
    // Bounded: a listener that accepts and never answers fails the example instead of hanging it.
    let response = tokio::time::timeout(Duration::from_secs(5), request).await??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or("the response has no header/body separator")?;
    let status = head.lines().next().unwrap_or_default();
    if !status.contains(" 200 ") {
        return Err(format!("scrape failed: {status}").into());
    }
    Ok(body.to_owned())
}

fn print_render_slot_lines(body: &str) {
    for line in body.lines().filter(|l| l.contains("render_slot")) {
        println!("  {line}");
    }
}

/// The value of an unlabelled sample, e.g. `render_slot_acquire_count 12`.
fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        if key == name {
            value.trim().parse().ok()
        } else {
            None
        }
    })
}
