//! A tour of leasehold on the embedded default (the in-process `LocalBroker`).
//!
//! Two slots, one explicit lease, nine jobs: six write frames into their temp dir on the
//! blocking pool, one fails, one panics, one is cancelled while its blocking writer is still
//! running. Every job prints its outcome code; at the end every slot is back.
//!
//! ```sh
//! cargo run --example quickstart
//! ```

use std::io;
use std::path::PathBuf;
use std::sync::mpsc;

use leasehold::{CancellationToken, JobError, JobSpec, Supervisor, WorkerContext};
use tokio::sync::oneshot;

/// What a successful job reports.
#[derive(Debug)]
struct Rendered {
    slot: u32,
    lease: u64,
    bytes: u64,
    temp_dir: PathBuf,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The worker catches a body's panic and reports it as LEASE_BODY_PANICKED; keep the default
    // hook's backtrace out of the demo's output.
    std::panic::set_hook(Box::new(|info| eprintln!("(caught by its worker) {info}")));

    let sup = Supervisor::builder().slots(2).start().await?;
    println!("work root: {}", sup.work_root().display());

    // The API boundary: an id that could escape the work root is refused before anything is
    // acquired.
    let refused = JobSpec::new("../../etc").unwrap_err();
    println!("{:<18} {}  ({refused})", "../../etc", refused.code());

    // An explicit lease, for code that cannot put its work in a closure.
    let mut lease = sup.acquire().await?;
    println!(
        "{:<18} OK  (explicit lease: slot {}, lease {})",
        "lease",
        lease.slot_id()?,
        lease.lease_id()?
    );
    lease.release().await?;
    lease.release().await?; // a no-op: the broker is not called twice

    let mut jobs = Vec::new();

    // Six jobs that write frames into their own temp dir on tokio's blocking pool.
    for n in 1..=6 {
        let id = format!("render-{n:04}");
        let body = move |ctx: WorkerContext| async move { render_frames(ctx, n).await };
        jobs.push((id.clone(), spawn_job(&sup, JobSpec::new(id)?, body)));
    }

    // A job whose body fails.
    let id = "render-0007-fail";
    let failing = |_ctx: WorkerContext| async move {
        Err::<Rendered, _>(io::Error::other("scene file is corrupt"))
    };
    jobs.push((id.into(), spawn_job(&sup, JobSpec::new(id)?, failing)));

    // A job whose body panics: the worker catches it, the slot still comes back.
    let id = "render-0008-panic";
    let panicking = |ctx: WorkerContext| async move {
        let spirv = compile_shader("")?;
        Ok(Rendered {
            slot: ctx.slot_id(),
            lease: ctx.lease_id(),
            bytes: spirv.len() as u64,
            temp_dir: ctx.temp_dir().to_path_buf(),
        })
    };
    jobs.push((id.into(), spawn_job(&sup, JobSpec::new(id)?, panicking)));

    // A job cancelled while it runs. Gates, not sleeps: the body says when it has started and
    // when it is about to return; its blocking writer waits for `release_writer`.
    let id = "render-0009-cancel";
    let token = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel::<PathBuf>();
    let (body_done_tx, body_done_rx) = oneshot::channel::<()>();
    let (release_writer, writer_gate) = mpsc::channel::<()>();
    let cancellable = move |ctx: WorkerContext| async move {
        let dir = ctx.temp_dir().to_path_buf();
        let _ = started_tx.send(dir.clone());
        // Tracked blocking work: the slot and the temp dir wait for it, even after the body
        // has returned.
        let _writer = ctx.spawn_blocking(move || {
            let _ = writer_gate.recv();
            std::fs::write(dir.join("partial.exr"), b"half a frame")
        });
        ctx.cancelled().await;
        let _ = body_done_tx.send(());
        Err::<Rendered, _>(io::Error::from(io::ErrorKind::Interrupted))
    };
    let job = JobSpec::new(id)?.with_cancel(token.clone());
    let cancelled_run = spawn_job(&sup, job, cancellable);

    let temp_dir = started_rx.await?;
    token.cancel();
    body_done_rx.await?;
    // The body has ended, but its blocking writer has not: the job still holds its slot and
    // its temp dir.
    assert!(
        temp_dir.exists(),
        "temp dir removed while tracked work was running"
    );
    assert!(
        !cancelled_run.is_finished(),
        "run returned while tracked work was running"
    );
    println!("{id:<18} body ended; slot and temp dir held until its blocking writer returns");
    release_writer.send(())?;
    jobs.push((id.into(), cancelled_run));

    for (id, handle) in jobs {
        match handle.await? {
            Ok(r) => {
                assert!(!r.temp_dir.exists(), "temp dir outlived its job");
                println!(
                    "{id:<18} OK  (slot {}, lease {}, {} bytes written, temp dir removed)",
                    r.slot, r.lease, r.bytes
                );
            }
            Err(err) => println!("{id:<18} {}  ({})", err.code(), describe(&err)),
        }
    }

    let report = sup.shutdown().await?;
    let stats = sup.stats();
    println!("stats:    {stats:?}");
    println!("shutdown: {report:?}");
    assert_eq!(stats.active, 0, "a slot did not come back");
    assert_eq!(stats.waiting, 0);
    assert_eq!(stats.quarantined, 0);
    assert_eq!(
        stats.acquired_total, stats.released_total,
        "every grant was released once"
    );
    assert!(
        !sup.work_root().exists(),
        "the owned work root is removed at shutdown"
    );
    println!("every slot came back; work root removed");
    Ok(())
}

/// Runs one job on its own task so that jobs queue for the two slots concurrently.
fn spawn_job<F, Fut>(
    sup: &Supervisor,
    job: JobSpec,
    body: F,
) -> tokio::task::JoinHandle<Result<Rendered, JobError<io::Error>>>
where
    F: FnOnce(WorkerContext) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Rendered, io::Error>> + Send + 'static,
{
    let sup = sup.clone();
    tokio::spawn(async move { sup.run(job, body).await })
}

/// A body that writes three frames into the job's temp dir with blocking I/O.
async fn render_frames(ctx: WorkerContext, n: u32) -> io::Result<Rendered> {
    let dir = ctx.temp_dir().to_path_buf();
    let writer = ctx.spawn_blocking(move || {
        let mut bytes = 0;
        for frame in 0..3 {
            let data = format!("job {n} frame {frame}\n").repeat(64);
            std::fs::write(dir.join(format!("frame-{frame}.txt")), &data)?;
            bytes += data.len() as u64;
        }
        Ok::<_, io::Error>(bytes)
    });
    let bytes = writer.await.map_err(io::Error::other)??;
    Ok(Rendered {
        slot: ctx.slot_id(),
        lease: ctx.lease_id(),
        bytes,
        temp_dir: ctx.temp_dir().to_path_buf(),
    })
}

/// Stands in for a library that panics on bad input.
fn compile_shader(source: &str) -> io::Result<Vec<u8>> {
    assert!(
        !source.is_empty(),
        "shader compiler crashed on an empty source"
    );
    Ok(source.as_bytes().to_vec())
}

/// The part of a job error worth printing: the body's failure and the cleanup's, when present.
fn describe(err: &JobError<io::Error>) -> String {
    let mut parts = Vec::new();
    if let Some(body) = err.body_error() {
        parts.push(match body.error() {
            Some(e) => format!("{body}: {e}"),
            None => body.to_string(),
        });
    }
    if let Some(cleanup) = err.cleanup_error() {
        match std::error::Error::source(cleanup) {
            Some(cause) => parts.push(format!("cleanup: {cleanup}: {cause}")),
            None => parts.push(format!("cleanup: {cleanup}")),
        }
    }
    if parts.is_empty() {
        parts.push(err.to_string());
    }
    parts.join("; ")
}
