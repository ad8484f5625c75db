//! A fixed-rate game loop that never awaits: it submits background bakes through leasehold,
//! polls their handles once a frame, cancels bakes that went stale, and keeps its frame time
//! steady while the slots do the heavy work.
//!
//! `cargo run --release --example frame_loop`
//!
//! With `--console` (built by leasehold-console: `cargo run --release -p leasehold-console
//! --example frame_loop_console -- --console`) it also serves leasehold's live web console on 127.0.0.1
//! (`--console=ADDR` for another address, which exposes it to whoever can reach it), prints its
//! URL (with `--console-actions`, it turns the actions on and prints their token), records
//! every bake's outcome there, and keeps serving after the loop until Enter is pressed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use leasehold::{JobHandle, JobSpec, Supervisor};

const FRAME: Duration = Duration::from_micros(16_667); // 60 Hz
const FRAMES: u32 = 180;
const CHUNKS: u32 = 3;
/// A new bake is requested every this many frames (more than two slots can keep up with).
const REQUEST_EVERY: u32 = 6;

/// A bake of one lightmap chunk: CPU work on the blocking pool that checks for cancellation.
fn bake(sup: &Supervisor, chunk: u32, version: u32) -> JobHandle<u64, std::io::Error> {
    let spec = JobSpec::new(format!("bake-c{chunk}-v{version}")).expect("valid id");
    sup.submit(spec, move |ctx| async move {
        let token = ctx.cancellation_token();
        let out = ctx.temp_dir().join("lightmap.bin");
        let checksum = ctx
            .spawn_blocking(move || {
                let mut x = u64::from(chunk) + 1;
                for i in 0..24u32 {
                    if token.is_cancelled() {
                        return Err(std::io::Error::from(std::io::ErrorKind::Interrupted));
                    }
                    // A slice of the bake: 5 ms of arithmetic (by the clock, so that debug and
                    // release builds bake alike).
                    let slice = Instant::now();
                    while slice.elapsed() < Duration::from_millis(5) {
                        for _ in 0..1_000 {
                            x = x
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(u64::from(i));
                        }
                    }
                }
                std::fs::write(&out, x.to_le_bytes())?;
                Ok(x)
            })
            .await
            .expect("the bake thread panicked")?;
        Ok(checksum)
    })
}

/// `--console` (loopback) or `--console=ADDR`: where to serve the web console, if at all; and
/// `--console-actions`: with its actions on, and their token printed (only when asked for).
fn console_args() -> Result<(Option<std::net::SocketAddr>, bool), Box<dyn std::error::Error>> {
    let (mut addr, mut actions) = (None, false);
    for arg in std::env::args().skip(1) {
        if arg == "--console" {
            addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        } else if let Some(a) = arg.strip_prefix("--console=") {
            addr = Some(a.parse()?);
        } else if arg == "--console-actions" {
            actions = true;
        } else {
            return Err(format!(
                "unknown argument `{arg}` (only --console[=ADDR] and --console-actions)"
            )
            .into());
        }
    }
    if actions && addr.is_none() {
        return Err("--console-actions needs --console".into());
    }
    Ok((addr, actions))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg_attr(not(leasehold_console), allow(unused_variables))]
    let (console_addr, console_actions) = console_args()?;
    #[cfg(not(leasehold_console))]
    if console_addr.is_some() {
        return Err(
            "--console needs the web console, which leasehold-console builds in: cargo run \
                    --release -p leasehold-console --example frame_loop_console -- --console"
                .into(),
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let sup = rt.block_on(Supervisor::builder().slots(2).start())?;
    // The web console, on the supervisor's runtime: the loop itself never awaits it.
    #[cfg(leasehold_console)]
    let console = match console_addr {
        Some(addr) => {
            let token = console_actions
                .then(leasehold_console::ActionsToken::random)
                .transpose()?;
            let mut builder = leasehold_console::Console::builder(sup.clone()).bind(addr);
            if let Some(token) = &token {
                builder = builder.actions(token.clone());
            }
            let console = rt.block_on(builder.start())?;
            match &token {
                Some(token) => println!(
                    "console: {} (actions token: {})",
                    console.url(),
                    token.expose()
                ),
                None => println!(
                    "console: {} (read-only; --console-actions turns the actions on and prints \
                     their token)",
                    console.url()
                ),
            }
            Some(console)
        }
        None => None,
    };
    #[cfg(leasehold_console)]
    let outcomes = console.as_ref().map(|c| c.outcomes());
    // Each finished bake's outcome, for the console's list (a no-op without it).
    let record = |_job: &str, _result: &Result<u64, leasehold::JobError<std::io::Error>>| {
        #[cfg(leasehold_console)]
        if let Some(outcomes) = &outcomes {
            outcomes.record(_job, _result);
        }
    };

    let mut pending: HashMap<u32, (u32, JobHandle<u64, std::io::Error>)> = HashMap::new();
    let mut cancelling: Vec<JobHandle<u64, std::io::Error>> = Vec::new();
    let (mut baked, mut cancelled, mut never_started, mut version) = (0u32, 0u32, 0u32, 0u32);
    let mut frame_times = Vec::with_capacity(FRAMES as usize);
    let start = Instant::now();
    println!("frame  frame ms  slots held  waiting  baked  cancelled");

    for frame in 0..FRAMES {
        let frame_start = Instant::now();

        // Every few frames the world changes near one chunk: request a fresh bake. Twice a
        // second the camera jumps and every chunk is requested at once. A bake still pending
        // for a chunk is stale: cancel it (its slot comes back only once its thread has
        // stopped, which the loop never waits for).
        let requested: Vec<u32> = if frame % 30 == 15 {
            (0..CHUNKS).collect()
        } else if frame % REQUEST_EVERY == 0 {
            vec![(frame / REQUEST_EVERY) % CHUNKS]
        } else {
            Vec::new()
        };
        for chunk in requested {
            version += 1;
            if let Some((_, stale)) = pending.remove(&chunk) {
                stale.cancel();
                cancelling.push(stale);
            }
            pending.insert(chunk, (version, bake(&sup, chunk, version)));
        }

        // Poll every handle without blocking.
        pending.retain(|_, (_, handle)| {
            let Some(result) = handle.try_take() else {
                return true;
            };
            record(handle.job_id(), &result);
            match result {
                Ok(_checksum) => baked += 1,
                Err(e) => eprintln!("bake {} failed: {} ({e})", handle.job_id(), e.code()),
            }
            false
        });
        cancelling.retain_mut(|handle| match handle.try_take() {
            None => true,
            Some(result) => {
                record(handle.job_id(), &result);
                match result {
                    // Stopped mid-bake, or withdrawn before it even got a slot.
                    Err(e) if e.code() == "LEASE_BODY_CANCELLED" => cancelled += 1,
                    Err(e) if e.code() == "LEASE_ACQUIRE_CANCELLED" => {
                        cancelled += 1;
                        never_started += 1;
                    }
                    Ok(_) => baked += 1, // it finished before it saw the cancellation
                    Err(e) => eprintln!("bake {} failed: {}", handle.job_id(), e.code()),
                }
                false
            }
        });

        // The frame's own work: a little simulation.
        let mut s = 0u64;
        for i in 0..20_000u64 {
            s = s.wrapping_add(i * i);
        }
        std::hint::black_box(s);

        let spent = frame_start.elapsed();
        frame_times.push(spent);
        if frame % 15 == 0 {
            let stats = sup.stats();
            println!(
                "{frame:>5}  {:>8.2}  {:>10}  {:>7}  {baked:>5}  {cancelled:>9}",
                spent.as_secs_f64() * 1e3,
                stats.active,
                stats.waiting
            );
        }
        if let Some(rest) = FRAME.checked_sub(spent) {
            // The loop's cadence: 60 frames a second.
            std::thread::sleep(rest);
        }
    }

    // Drain: let the last bakes finish (polling, as the loop would in its last frames).
    while !pending.is_empty() || !cancelling.is_empty() {
        pending.retain(|_, (_, h)| match h.try_take() {
            None => true,
            Some(r) => {
                record(h.job_id(), &r);
                baked += u32::from(r.is_ok());
                false
            }
        });
        cancelling.retain_mut(|h| match h.try_take() {
            None => true,
            Some(r) => {
                record(h.job_id(), &r);
                match r {
                    Ok(_) => baked += 1,
                    Err(e) => {
                        cancelled += 1;
                        never_started += u32::from(e.code() == "LEASE_ACQUIRE_CANCELLED");
                    }
                }
                false
            }
        });
        std::thread::sleep(Duration::from_millis(1));
    }

    let mut sorted = frame_times.clone();
    sorted.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let avg = frame_times.iter().sum::<Duration>() / frame_times.len() as u32;
    println!(
        "\n{FRAMES} frames in {:.2} s: frame work avg {:.3} ms, p99 {:.3} ms, max {:.3} ms (budget {:.3} ms)",
        start.elapsed().as_secs_f64(),
        ms(avg),
        ms(sorted[sorted.len() * 99 / 100]),
        ms(*sorted.last().unwrap()),
        ms(FRAME)
    );
    println!(
        "bakes: {version} requested, {baked} finished, {cancelled} cancelled as stale ({never_started} of them before they got a slot)"
    );
    assert_eq!(
        baked + cancelled,
        version,
        "every bake ended one way or the other"
    );
    #[cfg(leasehold_console)]
    if let Some(console) = console {
        println!(
            "console: still serving at {}; press Enter to stop",
            console.url()
        );
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        rt.block_on(console.shutdown())?;
    }
    let report = rt.block_on(sup.shutdown())?;
    println!("final stats: {:?}", report.stats);
    if report.stats.active != 0 || report.stats.quarantined != 0 {
        return Err("a slot did not come back".into());
    }
    Ok(())
}
