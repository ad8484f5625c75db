//! A quarantine made on purpose, to see the console's Quarantine panel and to reclaim the slot
//! from the page.
//!
//! One slot. A job replaces its temp dir by a plain file of the same name: the supervisor's
//! removal of the temp dir fails, so it cannot prove the slot clean and quarantines it, with
//! the reason. A second job waits for the slot (the Queue panel shows it). Delete the file (or
//! press Enter here and the example deletes it), then click "Reclaim quarantined slots" in the
//! console and confirm: the supervisor checks the slot again, finds the temp dir gone, releases
//! the slot, and the waiting job runs on it.
//!
//! ```sh
//! cargo run -p leasehold-console --example quarantine
//! cargo run -p leasehold-console --example quarantine -- --reclaim-self
//! ```
//!
//! `--reclaim-self` does what the user would, without a browser: it deletes the file and sends
//! the console's reclaim action over HTTP with the token, naming the quarantined lease as the
//! page does, then checks that the waiting job ran and that the history shows both jobs (the
//! repository's CI runs it so).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use leasehold::{JobSpec, Supervisor};
use leasehold_console::{ActionsToken, Console, JobNote};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bound on each wait of `--reclaim-self` (a step that takes longer is a failure).
const STEP: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> ExitCode {
    let reclaim_self = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--reclaim-self") => true,
        Some(other) => {
            eprintln!("quarantine: unknown argument `{other}` (only --reclaim-self)");
            return ExitCode::FAILURE;
        }
    };
    match run(reclaim_self).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quarantine: {e}");
            ExitCode::FAILURE
        }
    }
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn run(reclaim_self: bool) -> Result<(), Error> {
    let work_root = tempfile::Builder::new()
        .prefix("leasehold-quarantine-example-")
        .tempdir()?;
    let sup = Supervisor::builder()
        .slots(1)
        .work_root(work_root.path())
        .start()
        .await?;
    let token = ActionsToken::random()?;
    let console = Console::builder(sup.clone())
        .actions(token.clone())
        .start()
        .await?;
    let outcomes = console.outcomes();
    println!(
        "console: {} (actions token: {})",
        console.url(),
        token.expose()
    );

    // ---- the quarantine, on purpose ------------------------------------------------------------
    let (file_tx, file_rx) = tokio::sync::oneshot::channel::<PathBuf>();
    let result = sup
        .run(JobSpec::new("leaves-a-file")?, |ctx| async move {
            // Where the supervisor will look for the temp dir, a plain file instead.
            let dir = ctx.temp_dir().to_path_buf();
            std::fs::remove_dir(&dir)?;
            std::fs::write(&dir, b"a file where the job's temp dir must go\n")?;
            let _ = file_tx.send(dir);
            Ok::<_, std::io::Error>((ctx.slot_id(), ctx.lease_id()))
        })
        .await;
    let file = file_rx.await?;
    let code = result.as_ref().map_or_else(|e| e.code(), |_| "OK");
    if code != "LEASE_CLEANUP_UNCONFIRMED" {
        return Err(format!("expected LEASE_CLEANUP_UNCONFIRMED, the job ended {code}").into());
    }
    outcomes.record_with(
        "leaves-a-file",
        &result,
        JobNote::new().note("left a file where its temp dir must go, on purpose"),
    );
    let quarantined = sup.quarantined().await?;
    let Some(slot) = quarantined.first() else {
        return Err("the slot was not quarantined".into());
    };
    let (slot_id, lease_id) = (slot.token.slot_id(), slot.token.lease_id());
    println!(
        "quarantined: slot {slot_id} (lease {lease_id}): {}",
        slot.reason
    );

    // ---- a job that waits for the slot -------------------------------------------------------
    let waiting = sup.submit(JobSpec::new("after-the-quarantine")?, |ctx| async move {
        Ok::<_, std::io::Error>(ctx.slot_id())
    });

    if reclaim_self {
        std::fs::remove_file(&file)?;
        println!("deleted {}", file.display());
        let body = format!(r#"{{"lease_ids":[{lease_id}]}}"#);
        let (status, answer) = tokio::time::timeout(
            STEP,
            post(
                console.local_addr(),
                "/api/actions/reclaim",
                token.expose(),
                &body,
            ),
        )
        .await??;
        println!("reclaim: {status} {answer}");
        if status != 200 || !answer.contains(&format!(r#""lease_id":{lease_id}"#)) {
            return Err(format!("the reclaim did not free the slot: {status} {answer}").into());
        }
    } else {
        println!(
            "\nOpen the console, paste the token, and see the Quarantine panel (the job waiting \
             for the slot is in the Queue panel).\nTo reclaim the slot: delete the file\n    rm {}\n\
             (or press Enter here, and this example deletes it), then click \"Reclaim \
             quarantined slots\" in the console and confirm.\n",
            file.display()
        );
        let file = file.clone();
        tokio::task::spawn_blocking(move || delete_on_enter(&file));
    }

    // ---- the slot serves again -------------------------------------------------------------------
    let served = if reclaim_self {
        tokio::time::timeout(STEP, waiting.join()).await?
    } else {
        waiting.join().await
    };
    outcomes.record("after-the-quarantine", &served);
    let served_on = served?;
    println!("reclaimed: slot {served_on} ran after-the-quarantine (OK)");
    let stats = sup.stats();
    if stats.quarantined != 0 {
        return Err(format!("still quarantined: {stats:?}").into());
    }

    if reclaim_self {
        // The history shows both jobs: the quarantined one with its code and note.
        let history =
            tokio::time::timeout(STEP, get(console.local_addr(), "/api/history")).await??;
        for expected in [
            r#""code":"LEASE_CLEANUP_UNCONFIRMED""#,
            "on purpose",
            r#""job_id":"after-the-quarantine""#,
        ] {
            if !history.contains(expected) {
                return Err(format!("the history lacks {expected}: {history}").into());
            }
        }
        println!("history: both jobs, the quarantined one with its code and note");
    } else {
        println!(
            "console: still serving at {}; press Enter to stop",
            console.url()
        );
        tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)
        })
        .await??;
    }
    console.shutdown().await?;
    let report = sup.shutdown().await?;
    println!("shutdown: {} quarantined", report.quarantined);
    Ok(())
}

/// Deletes the file once Enter is pressed (if the user has not deleted it already). At the
/// end of standard input it leaves the file to the user.
fn delete_on_enter(file: &Path) {
    let mut line = String::new();
    if matches!(std::io::stdin().read_line(&mut line), Ok(n) if n > 0) {
        match std::fs::remove_file(file) {
            Ok(()) => println!(
                "deleted {}: now click \"Reclaim quarantined slots\" in the console",
                file.display()
            ),
            Err(e) => println!("{}: {e}", file.display()),
        }
        let _ = std::io::stdout().flush();
    }
}

/// One HTTP/1.1 request to the console (`Connection: close`): its status and body.
async fn exchange(addr: SocketAddr, request: String) -> Result<(u16, String), Error> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let raw = String::from_utf8(raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("no HTTP head")?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no HTTP status")?;
    Ok((status, body.to_owned()))
}

/// An action, as a command-line client sends it: JSON, with the token.
async fn post(
    addr: SocketAddr,
    path: &str,
    token: &str,
    body: &str,
) -> Result<(u16, String), Error> {
    exchange(
        addr,
        format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n\
             {body}",
            body.len()
        ),
    )
    .await
}

async fn get(addr: SocketAddr, path: &str) -> Result<String, Error> {
    let (status, body) = exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    )
    .await?;
    if status != 200 {
        return Err(format!("GET {path}: {status} {body}").into());
    }
    Ok(body)
}
