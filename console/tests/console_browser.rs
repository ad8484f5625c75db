//! The console in a real browser: headless Chromium (Debian's `chromium`) driven through the
//! DevTools protocol while a test supervisor runs jobs held in each phase by gates. The page
//! shows a lane per slot; a job going from running to draining (its tracked task still
//! running) to gone, then its outcome; a quarantined slot with its reason; the lanes and the
//! timeline in timeline.png's colours; a cancel without the token refused with 403 and
//! nothing changed; the same cancel with the token cancelling the job. Screenshots go to
//! `target/tmp/console-browser/` on every run.
//!
//! Without Chromium the test prints `*** SKIPPED: no chromium ... ***` and passes, unless `CI`
//! is set or `LEASEHOLD_REQUIRE_BROWSER=1`, when it fails. `LEASEHOLD_CHROMIUM` names another
//! binary.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chromiumoxide::browser::{Browser, BrowserConfig};
use chromiumoxide::cdp::browser_protocol::emulation::{
    MediaFeature, SetDeviceMetricsOverrideParams, SetEmulatedMediaParams,
};
use chromiumoxide::cdp::browser_protocol::page::CaptureScreenshotFormat;
use chromiumoxide::handler::viewport::Viewport;
use chromiumoxide::page::{Page, ScreenshotParams};
use futures_util::StreamExt;
use leasehold::{JobSpec, Supervisor};
use leasehold_console::{ActionsToken, Console};
use tokio::sync::oneshot;

const TOKEN: &str = "browser-test-token-0123456789";
/// Bound on every wait for the page to show something (in the browser, checked every 50 ms).
const PAGE_WAIT: Duration = Duration::from_secs(20);
/// Bound on every wait for a job to end.
const JOB_WAIT: Duration = Duration::from_secs(30);

fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("LEASEHOLD_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

fn browser_required() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
        || std::env::var("LEASEHOLD_REQUIRE_BROWSER").as_deref() == Ok("1")
}

fn shots_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-browser");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(page: &Page, name: &str) -> PathBuf {
    let path = shots_dir().join(name);
    page.save_screenshot(
        ScreenshotParams::builder()
            .format(CaptureScreenshotFormat::Png)
            .full_page(true)
            .build(),
        &path,
    )
    .await
    .expect("screenshot");
    let _ = writeln!(std::io::stderr(), "screenshot: {}", path.display());
    path
}

/// Waits, in the browser, until the JavaScript condition `cond` holds (re-checked every 50 ms,
/// for at most PAGE_WAIT); on a timeout, saves a screenshot and fails with the page's text.
async fn wait_for(page: &Page, what: &str, cond: &str) {
    let js = format!(
        "(async () => {{
            const deadline = Date.now() + {ms};
            while (Date.now() < deadline) {{
                try {{ if ({cond}) return true; }} catch (e) {{}}
                await new Promise((r) => setTimeout(r, 50));
            }}
            return false;
        }})()",
        ms = PAGE_WAIT.as_millis()
    );
    let shown: bool = page
        .evaluate_expression(js)
        .await
        .expect("the condition evaluates")
        .into_value()
        .expect("a boolean");
    if !shown {
        let shot = screenshot(page, "failure.png").await;
        let text: String = page
            .evaluate_expression("document.body.innerText")
            .await
            .and_then(|r| Ok(r.into_value()?))
            .unwrap_or_default();
        panic!(
            "the page never showed {what} (condition `{cond}`); screenshot {}; page text:\n{text}",
            shot.display()
        );
    }
}

async fn js<T: serde::de::DeserializeOwned>(page: &Page, expr: &str) -> T {
    page.evaluate_expression(expr)
        .await
        .unwrap_or_else(|e| panic!("`{expr}`: {e}"))
        .into_value()
        .unwrap_or_else(|e| panic!("`{expr}`: {e}"))
}

/// Clicks a button that asks to confirm first: the first click arms it (its text asks), the
/// second acts.
async fn confirm_click(page: &Page, selector: &str) {
    let button = page.find_element(selector).await.unwrap();
    button.click().await.unwrap();
    wait_for(
        page,
        "the button asking to confirm",
        &format!(
            "document.querySelector('{selector}').dataset.armed === 'true' && \
             document.querySelector('{selector}').textContent.startsWith('Confirm')"
        ),
    )
    .await;
    button.click().await.unwrap();
}

fn lane(job: &str) -> String {
    format!("document.querySelector('.lane[data-job=\"{job}\"]')")
}

/// Launches headless Chromium (`exe`) with a profile of its own; the browser, the task that
/// drives its DevTools connection, and the profile dir (removed when dropped).
async fn launch(exe: &Path) -> (Browser, tokio::task::JoinHandle<()>, tempfile::TempDir) {
    let profile = tempfile::Builder::new()
        .prefix("leasehold-chromium-profile-")
        .tempdir()
        .unwrap();
    let config = BrowserConfig::builder()
        .chrome_executable(exe)
        .disable_default_args()
        .no_sandbox()
        .user_data_dir(profile.path())
        .args([
            "disable-gpu",
            "disable-quic",
            "no-first-run",
            "disable-background-networking",
            "disable-component-update",
            "disable-sync",
            "disable-dev-shm-usage",
            "no-default-browser-check",
        ])
        .window_size(1280, 1100)
        .viewport(Viewport {
            width: 1280,
            height: 1100,
            ..Viewport::default()
        })
        .launch_timeout(Duration::from_secs(60))
        .request_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let (browser, mut handler) = Browser::launch(config)
        .await
        .unwrap_or_else(|e| panic!("chromium ({}) did not start: {e}", exe.display()));
    let devtools = tokio::spawn(async move {
        while let Some(event) = handler.next().await {
            if event.is_err() {
                break;
            }
        }
    });
    (browser, devtools, profile)
}

/// The page's skip or failure when there is no Chromium: `None` (said loudly) where that is allowed.
fn chromium_or_skip() -> Option<PathBuf> {
    let exe = chromium();
    if exe.is_none() {
        assert!(
            !browser_required(),
            "no chromium at /usr/bin/chromium (apt-get install chromium), and CI or \
             LEASEHOLD_REQUIRE_BROWSER=1 requires the browser test"
        );
        // Straight to stderr, past the test harness's capture: a skip must be seen.
        let _ = writeln!(
            std::io::stderr(),
            "\n*** SKIPPED: no chromium (apt-get install chromium, or set LEASEHOLD_CHROMIUM): \
             the console's browser test did not run ***\n"
        );
    }
    exe
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_slots_phases_quarantine_and_outcomes_and_guards_its_actions_in_a_real_browser()
 {
    let Some(exe) = chromium_or_skip() else {
        return;
    };

    // ---- the supervisor, its console, the browser -----------------------------------------
    let sup = Supervisor::builder().slots(3).start().await.unwrap();
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let outcomes = console.outcomes();
    let (mut browser, devtools, _profile) = launch(&exe).await;
    let page = browser.new_page(console.url()).await.unwrap();

    // ---- a lane per slot, live ---------------------------------------------------------------
    wait_for(
        &page,
        "the stream live",
        "document.querySelector('#conn').dataset.state === 'live'",
    )
    .await;
    wait_for(
        &page,
        "a lane per slot",
        "document.querySelectorAll('#lanes .lane').length === 3",
    )
    .await;
    let slots: Vec<String> = js(
        &page,
        "[...document.querySelectorAll('#lanes .lane')].map(l => l.dataset.slot)",
    )
    .await;
    assert_eq!(slots, ["0", "1", "2"]);
    wait_for(
        &page,
        "the actions panel",
        "!document.querySelector('#actions').hidden",
    )
    .await;

    // ---- a quarantined slot, with its reason ------------------------------------------------
    // Its temp dir replaced by a file: the removal fails and the slot is quarantined.
    let (dir_tx, dir_rx) = oneshot::channel();
    let clobbered = sup
        .run(JobSpec::new("clobbered").unwrap(), |ctx| async move {
            let _ = dir_tx.send(support::clobber_temp_dir(&ctx)?);
            Ok::<_, std::io::Error>(())
        })
        .await;
    assert_eq!(
        clobbered.as_ref().unwrap_err().code(),
        "LEASE_CLEANUP_UNCONFIRMED"
    );
    outcomes.record("clobbered", &clobbered);
    let clobbered_dir = dir_rx.await.unwrap();
    wait_for(
        &page,
        "the quarantined slot with its reason",
        "[...document.querySelectorAll('#quarantine tbody tr')].some(tr => \
            tr.querySelector('.job').textContent === 'clobbered' && \
            tr.querySelector('.reason').textContent.includes('could not be removed'))",
    )
    .await;
    wait_for(
        &page,
        "the quarantined lane",
        &format!("{}?.dataset.phase === 'quarantined'", lane("clobbered")),
    )
    .await;

    // ---- a victim, running until cancelled --------------------------------------------------
    let (victim_tx, victim_rx) = oneshot::channel();
    let victim = sup.submit(JobSpec::new("victim").unwrap(), move |ctx| async move {
        let _ = victim_tx.send(ctx.cancellation_token());
        ctx.cancelled().await;
        Err::<(), _>(std::io::Error::other("cancelled"))
    });
    let victim_token = victim_rx.await.unwrap();
    wait_for(
        &page,
        "the victim running",
        &format!("{}?.dataset.phase === 'running'", lane("victim")),
    )
    .await;

    // ---- a job from running to draining to gone ---------------------------------------------
    let (body_gate, body_rx) = oneshot::channel::<()>();
    let (task_gate, task_rx) = oneshot::channel::<()>();
    let held = sup.submit(JobSpec::new("held-job").unwrap(), move |ctx| async move {
        // A tracked task outlives the body: the slot drains until it ends.
        drop(ctx.spawn(async move {
            let _ = task_rx.await;
        }));
        let _ = body_rx.await;
        Ok::<_, std::io::Error>(())
    });
    wait_for(
        &page,
        "held-job running",
        &format!("{}?.dataset.phase === 'running'", lane("held-job")),
    )
    .await;
    let running_color: String = js(
        &page,
        &format!("getComputedStyle({}).borderLeftColor", lane("held-job")),
    )
    .await;
    assert_eq!(
        running_color, "rgb(70, 130, 180)",
        "running is steel blue, as in timeline.png"
    );
    body_gate.send(()).unwrap();
    wait_for(
        &page,
        "held-job draining, waiting for its tracked task",
        &format!(
            "{0}?.dataset.phase === 'draining' && {0}.querySelector('.waits').textContent.includes('tracked tasks')",
            lane("held-job")
        ),
    )
    .await;
    let draining_color: String = js(
        &page,
        &format!("getComputedStyle({}).borderLeftColor", lane("held-job")),
    )
    .await;
    assert_eq!(
        draining_color, "rgb(240, 190, 40)",
        "draining is amber, as in timeline.png"
    );
    let quarantined_color: String = js(
        &page,
        &format!("getComputedStyle({}).borderLeftColor", lane("clobbered")),
    )
    .await;
    assert_eq!(quarantined_color, "rgb(178, 34, 34)");
    // Every part of the page at once: the screenshot README shows.
    wait_for(&page, "the timeline's running and draining bars", "document.querySelector('#timeline rect.run') && document.querySelector('#timeline rect.drain') && document.querySelector('#timeline rect.quarantined')").await;
    screenshot(&page, "console.png").await;
    let run_fill: String = js(
        &page,
        "getComputedStyle(document.querySelector('#timeline rect.run')).fill",
    )
    .await;
    assert_eq!(run_fill, "rgb(70, 130, 180)");

    task_gate.send(()).unwrap();
    let held_result = tokio::time::timeout(JOB_WAIT, held.join())
        .await
        .expect("held-job ended");
    outcomes.record("held-job", &held_result);
    held_result.unwrap();
    wait_for(
        &page,
        "held-job gone, its outcome OK",
        &format!(
            "!{} && [...document.querySelectorAll('#outcomes tbody tr')].some(tr => \
                tr.dataset.job === 'held-job' && tr.querySelector('.code').textContent === 'OK')",
            lane("held-job")
        ),
    )
    .await;
    wait_for(
        &page,
        "a free lane again",
        "[...document.querySelectorAll('#lanes .lane')].filter(l => l.dataset.phase === 'idle').length === 1",
    )
    .await;

    // ---- cancel without the token: 403, nothing changed -------------------------------------
    let before = sup.stats();
    let input = page.find_element("#cancel-job").await.unwrap();
    input
        .click()
        .await
        .unwrap()
        .type_str("victim")
        .await
        .unwrap();
    confirm_click(&page, "#cancel-btn").await;
    wait_for(
        &page,
        "the refusal",
        "document.querySelector('#action-result').dataset.status === '403' && \
         document.querySelector('#action-result').dataset.code === 'CONSOLE_FORBIDDEN'",
    )
    .await;
    // The answer comes after any effect: none.
    assert!(
        !victim_token.is_cancelled(),
        "a refused cancel cancelled the job"
    );
    let after = sup.stats();
    assert_eq!(
        (after.active, after.quarantined, after.capacity),
        (before.active, before.quarantined, before.capacity)
    );
    assert_eq!(after.released_total, before.released_total);
    let frames: u64 = js(&page, "(window.consoleFrames || 0)").await;
    wait_for(
        &page,
        "the victim still running three frames later",
        &format!(
            "(window.consoleFrames || 0) >= {} && {}?.dataset.phase === 'running'",
            frames + 3,
            lane("victim")
        ),
    )
    .await;
    screenshot(&page, "console-refused.png").await;

    // ---- the same cancel with the token -----------------------------------------------------
    page.find_element("#token")
        .await
        .unwrap()
        .click()
        .await
        .unwrap()
        .type_str(TOKEN)
        .await
        .unwrap();
    confirm_click(&page, "#cancel-btn").await;
    wait_for(
        &page,
        "the cancel accepted, shown as requested",
        "document.querySelector('#action-result').dataset.status === '200' && \
         document.querySelector('#action-result').dataset.requested === 'victim' && \
         document.querySelector('#action-result').textContent.includes('cancel requested for victim')",
    )
    .await;
    assert!(victim_token.is_cancelled());
    let victim_result = tokio::time::timeout(JOB_WAIT, victim.join())
        .await
        .expect("the victim ended");
    assert_eq!(
        victim_result.as_ref().unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );
    outcomes.record("victim", &victim_result);
    wait_for(
        &page,
        "the victim gone, its outcome LEASE_BODY_CANCELLED",
        &format!(
            "!{} && [...document.querySelectorAll('#outcomes tbody tr')].some(tr => \
                tr.dataset.job === 'victim' && tr.querySelector('.code').textContent === 'LEASE_BODY_CANCELLED')",
            lane("victim")
        ),
    )
    .await;

    // The answer to the cancel now says how the job ended.
    wait_for(
        &page,
        "the cancel's outcome shown",
        "document.querySelector('#action-result').dataset.ended === 'LEASE_BODY_CANCELLED' && \
         document.querySelector('#action-result').textContent.includes('it ended: LEASE_BODY_CANCELLED')",
    )
    .await;

    // ---- reclaim from the page --------------------------------------------------------------
    std::fs::remove_file(&clobbered_dir).unwrap();
    page.find_element("#reclaim-btn")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(
        &page,
        "the quarantine emptied",
        "document.querySelector('#action-result').dataset.status === '200' && \
         document.querySelectorAll('#quarantine tbody tr').length === 0 && \
         !document.querySelector('#quarantine-empty').hidden",
    )
    .await;

    // ---- the history: a filter by code, a search by id, a job's detail ----------------------
    let history_rows =
        "[...document.querySelectorAll('#outcomes tbody tr')].map(tr => tr.dataset.job)";
    page.find_element("#history-code")
        .await
        .unwrap()
        .click()
        .await
        .unwrap()
        .type_str("LEASE_BODY_CANCELLED")
        .await
        .unwrap();
    wait_for(
        &page,
        "the history filtered by code",
        &format!("JSON.stringify({history_rows}) === '[\"victim\"]'"),
    )
    .await;
    page.find_element("#outcomes tbody tr")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(
        &page,
        "the victim's detail: its slot, its run, its drain, its body error",
        "!document.querySelector('#detail').hidden && \
         document.querySelector('#detail').dataset.job === 'victim' && \
         [...document.querySelectorAll('#detail dt')].map(d => d.textContent).join() \
           .includes('ran') && \
         document.querySelector('#detail').textContent.includes('body error') && \
         document.querySelector('#detail').textContent.includes('cancelled')",
    )
    .await;
    screenshot(&page, "console-detail.png").await;
    js::<bool>(
        &page,
        "document.querySelector('#history-code').value = ''; \
        document.querySelector('#history-code').dispatchEvent(new Event('input')); true",
    )
    .await;
    page.find_element("#history-search")
        .await
        .unwrap()
        .click()
        .await
        .unwrap()
        .type_str("held")
        .await
        .unwrap();
    wait_for(
        &page,
        "the history searched by job id",
        &format!("JSON.stringify({history_rows}) === '[\"held-job\"]'"),
    )
    .await;

    // ---- the charts of the last minutes, drawn in the page -------------------------------------
    wait_for(
        &page,
        "four charts, the throughput's with the ends so far",
        "document.querySelectorAll('#charts .chart svg').length === 4 && \
         document.querySelector('.chart[data-chart=\"throughput\"] polyline') !== null && \
         Number(document.querySelector('.chart[data-chart=\"throughput\"]').dataset.points) > 0 && \
         document.querySelector('.chart[data-chart=\"queue\"] polyline') !== null",
    )
    .await;

    // ---- a selection survives ten updates; a pause stops them ---------------------------------
    let frames = "(window.consoleFrames || 0)";
    let selected: String = js(
        &page,
        "(() => { const td = document.querySelector('#outcomes tbody tr td.job'); \
           const r = document.createRange(); r.selectNodeContents(td); \
           const s = window.getSelection(); s.removeAllRanges(); s.addRange(r); \
           window.__frames = (window.consoleFrames || 0); return s.toString(); })()",
    )
    .await;
    assert_eq!(selected, "held-job");
    wait_for(
        &page,
        "ten more frames",
        &format!("{frames} >= window.__frames + 10"),
    )
    .await;
    let still: String = js(&page, "window.getSelection().toString()").await;
    assert_eq!(
        still, "held-job",
        "the selection did not survive ten updates"
    );
    page.find_element("#pause")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let clock: String = js(&page, "document.querySelector('#clock').textContent").await;
    wait_for(
        &page,
        "ten frames while paused",
        &format!("{frames} >= window.__frames + 25"),
    )
    .await;
    let paused_clock: String = js(&page, "document.querySelector('#clock').textContent").await;
    assert_eq!(clock, paused_clock, "a paused page kept updating");
    page.find_element("#pause")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();

    // ---- resize with an empty field: nothing is sent ------------------------------------------
    let capacity = sup.stats().capacity;
    page.find_element("#resize-btn")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(
        &page,
        "an empty resize field refused on the page",
        "document.querySelector('#action-result').textContent.includes('type the number of slots first')",
    )
    .await;
    assert_eq!(
        sup.stats().capacity,
        capacity,
        "an empty field resized the pool"
    );
    screenshot(&page, "console-final.png").await;

    // ---- done ---------------------------------------------------------------------------------
    browser.close().await.unwrap();
    let _ = browser.wait().await;
    devtools.await.unwrap();
    console.shutdown().await.unwrap();
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0, "{report:?}");
    assert_eq!(report.stats.active, 0);
}

/// Opens one event stream from a plain socket, as another tab would, and waits for its first
/// frame: it holds one of the console's stream places until dropped.
async fn hold_stream(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!(
                "GET /api/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.windows(6).any(|w| w == b"data: ") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream closed before its first frame");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    stream
}

/// With every stream place taken, the page is not locked out: the stream's refusal (a 429 the
/// browser does not retry) makes it poll the snapshot, it goes live again once a place is free,
/// and while the console cannot be reached it says so instead of showing empty tables as facts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_polls_while_the_stream_cap_is_full_and_says_when_it_is_disconnected() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let sup = Supervisor::builder().slots(2).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let mut others = Vec::new();
    for _ in 0..leasehold_console::MAX_STREAMS {
        others.push(hold_stream(console.local_addr()).await);
    }
    let (mut browser, devtools, _profile) = launch(&exe).await;
    let page = browser.new_page(console.url()).await.unwrap();
    wait_for(
        &page,
        "polling while every stream place is taken, with fresh frames",
        "document.querySelector('#conn').dataset.state === 'polling' && \
         (window.consoleFrames || 0) >= 3 && \
         document.querySelectorAll('#lanes .lane').length === 2 && \
         document.querySelector('#stale').hidden",
    )
    .await;
    screenshot(&page, "console-polling.png").await;
    // A phone's width: no horizontal scroll.
    page.execute(SetDeviceMetricsOverrideParams::new(390, 844, 1.0, true))
        .await
        .unwrap();
    wait_for(
        &page,
        "the page within 390 px",
        "window.innerWidth === 390 && document.documentElement.scrollWidth <= 390",
    )
    .await;
    screenshot(&page, "console-390px.png").await;
    // Dark mode, from the system's preference.
    page.execute(SetEmulatedMediaParams {
        media: None,
        features: Some(vec![MediaFeature {
            name: "prefers-color-scheme".into(),
            value: "dark".into(),
        }]),
    })
    .await
    .unwrap();
    wait_for(
        &page,
        "a dark page under prefers-color-scheme: dark",
        "getComputedStyle(document.body).backgroundColor === 'rgb(23, 24, 26)'",
    )
    .await;
    screenshot(&page, "console-dark.png").await;
    // A place frees: the page goes back to the live stream.
    others.pop();
    wait_for(
        &page,
        "live again once a stream place is free",
        "document.querySelector('#conn').dataset.state === 'live'",
    )
    .await;
    // The console goes away: the page says it is disconnected, and claims no empty table.
    drop(others);
    console.shutdown().await.unwrap();
    wait_for(
        &page,
        "disconnected, said so, without empty tables as facts",
        "document.querySelector('#conn').dataset.state === 'lost' && \
         !document.querySelector('#stale').hidden && \
         document.querySelector('#quarantine-empty').hidden && \
         document.querySelector('#outcomes-empty').hidden && \
         document.body.dataset.stale === 'true'",
    )
    .await;
    screenshot(&page, "console-disconnected.png").await;
    browser.close().await.unwrap();
    let _ = browser.wait().await;
    devtools.await.unwrap();
    sup.shutdown().await.unwrap();
}
