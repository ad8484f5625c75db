//! The console in a real browser: headless Chromium (Debian's `chromium`) driven through the
//! DevTools protocol, with real mouse and key input, while a test supervisor runs jobs held in
//! each phase by gates.
//!
//! - The page: a lane per slot; a job going from running to draining (its tracked task still
//!   running) to gone, then its outcome; a quarantined slot with its reason; the lanes and the
//!   timeline in timeline.png's colours; a cancel without the token refused with 403 and
//!   nothing changed; the same cancel with the token cancelling the job.
//! - Every action acts on exactly what the user confirmed: a lane's cancel armed for one job
//!   never cancels the job the slot passes to, and the server refuses a lease that is no longer
//!   the job's; every action asks to confirm first; a double-click, or Enter held down (its
//!   auto-repeats), only arms (a separate click or key press, once the button is ready,
//!   confirms); a control the page hides is not shown.
//! - Answers and details show beside the click; the history is paged and the page stays short
//!   with a thousand job ends.
//! - The queue never lists a job that the same frame shows holding a slot.
//! - The charts have a time axis, a y scale, a legend, the last complete second as "now" and a
//!   visible dot for a lone value (read from the drawn SVG).
//! - An embedder's label and note show in the history; codes break between their words.
//! - The README's screenshots (1400 px and 390 px wide) are taken of today's page: with
//!   `LEASEHOLD_UPDATE_DOCS=1` they are written to `console/docs/`.
//!
//! Screenshots go to `target/tmp/console-browser/` on every run. The tests share one lock, so
//! that one browser runs at a time on a small machine.
//!
//! Without Chromium the tests print `*** SKIPPED: no chromium ... ***` and pass, unless `CI`
//! is set or `LEASEHOLD_REQUIRE_BROWSER=1`, when they fail. `LEASEHOLD_CHROMIUM` names another
//! binary.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chromiumoxide::browser::{Browser, BrowserConfig};
use chromiumoxide::cdp::browser_protocol::emulation::{
    MediaFeature, SetDeviceMetricsOverrideParams, SetEmulatedMediaParams,
};
use chromiumoxide::cdp::browser_protocol::input::{
    DispatchKeyEventParams, DispatchKeyEventType, DispatchMouseEventParams, DispatchMouseEventType,
    MouseButton,
};
use chromiumoxide::cdp::browser_protocol::page::CaptureScreenshotFormat;
use chromiumoxide::handler::viewport::Viewport;
use chromiumoxide::page::{Page, ScreenshotParams};
use futures_util::StreamExt;
use leasehold::{CancellationToken, JobHandle, JobSpec, Supervisor};
use leasehold_console::{ActionsToken, Console, ConsoleHandle, JobNote};
use tokio::sync::oneshot;

const TOKEN: &str = "browser-test-token-0123456789";
/// Bound on every wait for the page to show something (in the browser, checked every 50 ms).
const PAGE_WAIT: Duration = Duration::from_secs(20);
/// Bound on every wait for a job to end.
const JOB_WAIT: Duration = Duration::from_secs(30);

/// One browser at a time: every test of this file holds this lock while its browser runs (two
/// cores are shared by Chromium's processes, the supervisor and the test).
static ONE_BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

/// Waits until the page has applied `n` more frames.
async fn frames_later(page: &Page, n: u64) {
    let now: u64 = js(page, "(window.consoleFrames || 0)").await;
    wait_for(
        page,
        &format!("{n} more frames"),
        &format!("(window.consoleFrames || 0) >= {}", now + n),
    )
    .await;
}

async fn js<T: serde::de::DeserializeOwned>(page: &Page, expr: &str) -> T {
    page.evaluate_expression(expr)
        .await
        .unwrap_or_else(|e| panic!("`{expr}`: {e}"))
        .into_value()
        .unwrap_or_else(|e| panic!("`{expr}`: {e}"))
}

/// A real mouse click on the element (scrolled into view first), that reached it.
///
/// The page re-renders ten times a second and its sections above a button change height (a lane
/// goes, a queue row comes), so the layout can move between the moment the browser measures the
/// element and the moment the mouse presses and releases there (three DevTools round trips): the
/// click then lands on whatever moved under the pointer. A guard in the capture phase sees every
/// click first: one that reached the element goes on to the page's own handlers; one that missed
/// is swallowed (no control's click handler hears it; the press may still have moved the
/// focus) and the click is tried again, as a user would click again. An element that every try
/// misses fails the test, naming what was hit instead.
async fn click(page: &Page, selector: &str) {
    const TRIES: u32 = 5;
    let mut missed = Vec::new();
    for _ in 0..TRIES {
        js::<bool>(
            page,
            &format!(
                "(() => {{ const sel = {selector:?}; \
                 if (window.__clickGuard) window.removeEventListener('click', window.__clickGuard, true); \
                 window.__clickHit = ''; \
                 window.__clickGuard = (e) => {{ \
                   window.removeEventListener('click', window.__clickGuard, true); \
                   window.__clickGuard = null; \
                   const want = document.querySelector(sel); \
                   if (want && want.contains(e.target)) {{ window.__clickHit = 'hit'; return; }} \
                   const t = e.target; \
                   window.__clickHit = t.tagName + (t.id ? '#' + t.id : '') + \
                     (t.className && typeof t.className === 'string' ? '.' + t.className : ''); \
                   e.stopImmediatePropagation(); e.preventDefault(); }}; \
                 window.addEventListener('click', window.__clickGuard, true); return true; }})()"
            ),
        )
        .await;
        page.find_element(selector)
            .await
            .unwrap_or_else(|e| panic!("no `{selector}`: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("clicking `{selector}`: {e}"));
        // The page's click handlers have run when the mouse's release returns. No click at all
        // (the element pressed was replaced before the release, or it is disabled) is a miss
        // too: the guard comes off and the click is tried again.
        let hit: String = js(
            page,
            "(() => { const hit = window.__clickHit; \
               if (window.__clickGuard) { \
                 window.removeEventListener('click', window.__clickGuard, true); \
                 window.__clickGuard = null; } \
               return hit || 'no click delivered'; })()",
        )
        .await;
        if hit == "hit" {
            if !missed.is_empty() {
                let _ = writeln!(
                    std::io::stderr(),
                    "a click on `{selector}` first landed on {missed:?} (the layout moved under it)"
                );
            }
            return;
        }
        missed.push(hit);
    }
    panic!("{TRIES} clicks on `{selector}` all landed elsewhere: {missed:?}");
}

/// Clicks into a field (a click that reached it, see [`click`]) and types `text`, key by key.
async fn type_into(page: &Page, selector: &str, text: &str) {
    click(page, selector).await;
    page.find_element(selector)
        .await
        .unwrap_or_else(|e| panic!("no `{selector}`: {e}"))
        .type_str(text)
        .await
        .unwrap();
}

/// Empties a field (as a user selecting its text and deleting it would).
async fn clear(page: &Page, selector: &str) {
    js::<bool>(
        page,
        &format!(
            "(() => {{ const i = document.querySelector('{selector}'); i.value = ''; \
             i.dispatchEvent(new Event('input')); return true; }})()"
        ),
    )
    .await;
}

/// The first click on a button that asks to confirm: it arms, its text asking `question`; then
/// waits until it is ready to take the confirming click (see [`ready`]).
async fn arm(page: &Page, selector: &str, question: &str) {
    click(page, selector).await;
    wait_for(
        page,
        &format!("`{selector}` asking “{question}”"),
        &format!(
            "document.querySelector('{selector}').dataset.armed === 'true' && \
             document.querySelector('{selector}').textContent.startsWith({question:?})"
        ),
    )
    .await;
    ready(page, selector).await;
}

/// Waits until an armed button takes a confirming click: a click sooner after arming (the rest
/// of a double-click) only leaves it asking. The page says so with `data-ready`, set by a timer.
async fn ready(page: &Page, selector: &str) {
    wait_for(
        page,
        &format!("`{selector}` armed and ready to confirm"),
        &format!(
            "document.querySelector('{selector}').dataset.armed === 'true' && \
             document.querySelector('{selector}').dataset.ready === 'true'"
        ),
    )
    .await;
}

/// Records, from now on, every click the element `selector` hears (in the capture phase, before
/// the page's handlers): its `detail` (the browser's click count; 0 from a key) and whether the
/// button was ready to confirm then. Read with [`heard`].
async fn listen_clicks(page: &Page, selector: &str) {
    js::<bool>(
        page,
        &format!(
            "(() => {{ const sel = {selector:?}; window.__heard = []; \
             if (window.__hear) document.removeEventListener('click', window.__hear, true); \
             window.__hear = (e) => {{ const b = document.querySelector(sel); \
               if (b && b.contains(e.target)) window.__heard.push([e.detail, b.dataset.ready === 'true']); }}; \
             document.addEventListener('click', window.__hear, true); return true; }})()"
        ),
    )
    .await;
}

async fn heard(page: &Page) -> Vec<(i64, bool)> {
    js(page, "window.__heard").await
}

/// A real double-click at the element's centre (scrolled into view): the mouse pressed and
/// released twice, with the browser's click count 1, then 2, as a user's double-click sends.
async fn double_click(page: &Page, selector: &str) {
    let point = page
        .find_element(selector)
        .await
        .unwrap_or_else(|e| panic!("no `{selector}`: {e}"))
        .scroll_into_view()
        .await
        .unwrap()
        .clickable_point()
        .await
        .unwrap();
    page.move_mouse(point).await.unwrap();
    for count in [1, 2] {
        for kind in [
            DispatchMouseEventType::MousePressed,
            DispatchMouseEventType::MouseReleased,
        ] {
            let event = DispatchMouseEventParams::builder()
                .r#type(kind)
                .x(point.x)
                .y(point.y)
                .button(MouseButton::Left)
                .click_count(count)
                .build()
                .unwrap();
            page.execute(event).await.unwrap();
        }
    }
}

/// Enter on the focused element, as a keyboard sends it: pressed (with its text, so that a
/// focused button hears a click of `detail` 0), pressed again while held (`repeat`: the
/// keyboard's auto-repeat, which clicks the button again), or released.
#[derive(Clone, Copy, PartialEq)]
enum Enter {
    Down,
    Repeat,
    Up,
}

async fn enter(page: &Page, what: Enter) {
    let event = DispatchKeyEventParams::builder()
        .key("Enter")
        .code("Enter")
        .windows_virtual_key_code(13)
        .native_virtual_key_code(13);
    let event = match what {
        Enter::Down | Enter::Repeat => event
            .r#type(DispatchKeyEventType::KeyDown)
            .text("\r")
            .auto_repeat(what == Enter::Repeat),
        Enter::Up => event.r#type(DispatchKeyEventType::KeyUp),
    };
    page.execute(event.build().unwrap()).await.unwrap();
}

/// Clicks a button that asks to confirm first: the first click arms it (its text asks), the
/// second acts.
async fn confirm_click(page: &Page, selector: &str) {
    arm(page, selector, "Confirm").await;
    click(page, selector).await;
}

fn lane(job: &str) -> String {
    format!("document.querySelector('.lane[data-job=\"{job}\"]')")
}

/// Counts, in the page, every POST it sends (the actions): `window.__posts`.
const COUNT_POSTS: &str = "(() => { if (!window.__posts) { window.__posts = []; \
    const f = window.fetch; window.fetch = (url, init) => { \
    if (init && init.method === 'POST') window.__posts.push(String(url)); \
    return f(url, init); }; } return true; })()";

async fn posts(page: &Page) -> Vec<String> {
    js(page, "window.__posts").await
}

/// How far apart, vertically, two elements' centres are (CSS pixels).
async fn vertical_gap(page: &Page, a: &str, b: &str) -> f64 {
    js(
        page,
        &format!(
            "(() => {{ const c = (s) => {{ const r = document.querySelector(s).getBoundingClientRect(); \
             return r.top + r.height / 2; }}; return Math.abs(c({a:?}) - c({b:?})); }})()"
        ),
    )
    .await
}

/// Headless Chromium with a profile of its own, and the task that drives its DevTools
/// connection; closed by [`Chrome::close`].
struct Chrome {
    browser: Browser,
    devtools: tokio::task::JoinHandle<()>,
    _profile: tempfile::TempDir,
}

impl Chrome {
    /// Launches `exe` with a window (and viewport) of `width` × `height` CSS pixels.
    async fn launch(exe: &Path, width: u32, height: u32) -> Chrome {
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
                "hide-scrollbars",
            ])
            .window_size(width, height)
            .viewport(Viewport {
                width,
                height,
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
        Chrome {
            browser,
            devtools,
            _profile: profile,
        }
    }

    /// Opens the console's page and waits until its stream is live and its first frame shown.
    async fn open(&self, console: &ConsoleHandle) -> Page {
        let page = self.browser.new_page(console.url()).await.unwrap();
        wait_for(
            &page,
            "the stream live",
            "document.querySelector('#conn').dataset.state === 'live' && \
             (window.consoleFrames || 0) >= 1",
        )
        .await;
        page
    }

    async fn close(mut self) {
        self.browser.close().await.unwrap();
        let _ = self.browser.wait().await;
        self.devtools.await.unwrap();
    }
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

/// Waits until `n` callers wait for a slot. `submit` sends its request from a task of its own:
/// a test that needs the queue's order submits the next job only once the last one waits.
async fn queued(sup: &Supervisor, n: usize) {
    tokio::time::timeout(JOB_WAIT, async {
        while sup.stats().waiting < n {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{n} callers never waited"));
}

/// A job that runs until its gate opens (then `Ok`) or it is cancelled (then
/// `LEASE_BODY_CANCELLED`); its body says when it starts, with its own cancellation token and
/// its lease.
struct Gated {
    gate: Option<oneshot::Sender<()>>,
    started: Option<oneshot::Receiver<(CancellationToken, u64)>>,
    handle: JobHandle<(), std::io::Error>,
}

impl Gated {
    fn submit(sup: &Supervisor, id: &str) -> Gated {
        let (gate, gate_rx) = oneshot::channel::<()>();
        let (started_tx, started) = oneshot::channel();
        let handle = sup.submit(JobSpec::new(id).unwrap(), move |ctx| async move {
            let _ = started_tx.send((ctx.cancellation_token(), ctx.lease_id()));
            tokio::select! {
                _ = gate_rx => Ok(()),
                () = ctx.cancelled() => Err(std::io::Error::other("cancelled")),
            }
        });
        Gated {
            gate: Some(gate),
            started: Some(started),
            handle,
        }
    }

    /// Waits for its body to start: its cancellation token and its lease.
    async fn started(&mut self) -> (CancellationToken, u64) {
        tokio::time::timeout(JOB_WAIT, self.started.take().expect("asked once"))
            .await
            .expect("the job started")
            .expect("its body started")
    }

    fn open(&mut self) {
        let _ = self.gate.take().expect("opened once").send(());
    }

    async fn join(self) -> Result<(), leasehold::JobError<std::io::Error>> {
        tokio::time::timeout(JOB_WAIT, self.handle.join())
            .await
            .expect("the job ended")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_slots_phases_quarantine_and_outcomes_and_guards_its_actions_in_a_real_browser()
 {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;

    // ---- the supervisor, its console, the browser -----------------------------------------
    let sup = Supervisor::builder().slots(3).start().await.unwrap();
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let outcomes = console.outcomes();
    let chrome = Chrome::launch(&exe, 1280, 1100).await;
    let page = chrome.open(&console).await;

    // ---- a lane per slot, live ---------------------------------------------------------------
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
    type_into(&page, "#cancel-job", "victim").await;
    confirm_click(&page, "#cancel-btn").await;
    wait_for(
        &page,
        "the refusal, saying there was no token",
        "document.querySelector('#cancel-result').dataset.status === '403' && \
         document.querySelector('#cancel-result').dataset.code === 'CONSOLE_FORBIDDEN' && \
         document.querySelector('#cancel-result').textContent.includes('no token')",
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
    type_into(&page, "#token", TOKEN).await;
    confirm_click(&page, "#cancel-btn").await;
    wait_for(
        &page,
        "the cancel accepted, shown as requested, for the lease confirmed",
        "document.querySelector('#cancel-result').dataset.status === '200' && \
         document.querySelector('#cancel-result').dataset.requested === 'victim' && \
         document.querySelector('#cancel-result').textContent.includes('cancel requested for victim (lease')",
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
        "document.querySelector('#cancel-result').dataset.ended === 'LEASE_BODY_CANCELLED' && \
         document.querySelector('#cancel-result').textContent.includes('it ended: LEASE_BODY_CANCELLED')",
    )
    .await;

    // ---- reclaim from the page --------------------------------------------------------------
    std::fs::remove_file(&clobbered_dir).unwrap();
    confirm_click(&page, "#reclaim-btn").await;
    wait_for(
        &page,
        "the quarantine emptied",
        "document.querySelector('#reclaim-result').dataset.status === '200' && \
         document.querySelectorAll('#quarantine tbody tr').length === 0 && \
         !document.querySelector('#quarantine-empty').hidden",
    )
    .await;

    // ---- the history: a filter by code, a search by id, a job's detail ----------------------
    let history_rows =
        "[...document.querySelectorAll('#outcomes tbody tr')].map(tr => tr.dataset.job)";
    type_into(&page, "#history-code", "LEASE_BODY_CANCELLED").await;
    wait_for(
        &page,
        "the history filtered by code",
        &format!("JSON.stringify({history_rows}) === '[\"victim\"]'"),
    )
    .await;
    click(&page, "#outcomes tbody tr").await;
    wait_for(
        &page,
        "the victim's detail: its slot, its run, its drain, its body error",
        "document.querySelector('#detail').open && \
         document.querySelector('#detail').dataset.job === 'victim' && \
         [...document.querySelectorAll('#detail dt')].map(d => d.textContent).join() \
           .includes('ran') && \
         document.querySelector('#detail').textContent.includes('body error') && \
         document.querySelector('#detail').textContent.includes('cancelled')",
    )
    .await;
    screenshot(&page, "console-detail.png").await;
    click(&page, "#detail-close").await;
    wait_for(
        &page,
        "the detail closed",
        "!document.querySelector('#detail').open",
    )
    .await;
    js::<bool>(
        &page,
        "document.querySelector('#history-code').value = ''; \
        document.querySelector('#history-code').dispatchEvent(new Event('input')); true",
    )
    .await;
    type_into(&page, "#history-search", "held").await;
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
         document.querySelector('.chart[data-chart=\"throughput\"] :is(polyline, circle)') !== null && \
         Number(document.querySelector('.chart[data-chart=\"throughput\"]').dataset.points) > 0 && \
         document.querySelector('.chart[data-chart=\"queue\"] :is(polyline, circle)') !== null",
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
    click(&page, "#pause").await;
    let clock: String = js(&page, "document.querySelector('#clock').textContent").await;
    wait_for(
        &page,
        "ten frames while paused",
        &format!("{frames} >= window.__frames + 25"),
    )
    .await;
    let paused_clock: String = js(&page, "document.querySelector('#clock').textContent").await;
    assert_eq!(clock, paused_clock, "a paused page kept updating");
    click(&page, "#pause").await;

    // ---- resize with an empty field: nothing is sent ------------------------------------------
    let capacity = sup.stats().capacity;
    click(&page, "#resize-btn").await;
    wait_for(
        &page,
        "an empty resize field refused on the page",
        "document.querySelector('#resize-result').textContent.includes('type the number of slots first')",
    )
    .await;
    assert_eq!(
        sup.stats().capacity,
        capacity,
        "an empty field resized the pool"
    );
    screenshot(&page, "console-final.png").await;

    // ---- done ---------------------------------------------------------------------------------
    chrome.close().await;
    console.shutdown().await.unwrap();
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0, "{report:?}");
    assert_eq!(report.stats.active, 0);
}

/// A blank page in a fresh browser, set up by the JavaScript `setup` (which returns `true`),
/// holding the one-browser lock; `None` where the browser test is skipped.
async fn scratch_page(setup: &str) -> Option<(tokio::sync::MutexGuard<'static, ()>, Chrome, Page)> {
    let exe = chromium_or_skip()?;
    let one = ONE_BROWSER.lock().await;
    let chrome = Chrome::launch(&exe, 800, 600).await;
    let page = chrome.browser.new_page("about:blank").await.unwrap();
    js::<bool>(&page, setup).await;
    Some((one, chrome, page))
}

/// The tests' own click ([`click`]) reaches the element it names even when the layout moves
/// under the mouse, and a click that lands elsewhere reaches no control: this page puts a button
/// of its own above the target when the mouse first moves in (as a re-render that adds a row
/// would), so the first press and release land on that button. Its handler must not run, and
/// the target's must run exactly once. With a plain coordinate click, the other button acts and
/// the target never hears the click.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_click_the_layout_moves_off_its_element_reaches_no_control_and_is_tried_again() {
    let Some((_one, chrome, page)) = scratch_page(
        "(() => { document.body.innerHTML = '<div id=\"above\"></div><button id=\"target\">target</button>'; \
           window.targetClicks = 0; window.otherClicks = 0; window.shifted = false; \
           document.querySelector('#target').addEventListener('click', () => window.targetClicks++); \
           document.addEventListener('mousemove', () => { \
             if (window.shifted) return; window.shifted = true; \
             const b = document.createElement('button'); b.id = 'other'; b.textContent = 'other'; \
             b.style.display = 'block'; b.style.width = '100%'; b.style.height = '300px'; \
             b.addEventListener('click', () => window.otherClicks++); \
             document.querySelector('#above').appendChild(b); }); \
           return true; })()",
    )
    .await
    else {
        return;
    };
    click(&page, "#target").await;
    let (target, other, shifted): (u32, u32, bool) = js(
        &page,
        "[window.targetClicks, window.otherClicks, window.shifted]",
    )
    .await;
    assert!(shifted, "the page never moved its layout under the mouse");
    assert_eq!(
        (target, other),
        (1, 0),
        "the click reached the target {target} times and the button that moved under it {other} times"
    );
    chrome.close().await;
}

/// The tests' own click is tried again when no click came at all: here the page replaces the
/// button between the mouse's press and its release (as a re-render that rebuilds a row would),
/// so the browser sends no click. The second try reaches the new button.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_click_that_never_comes_because_its_element_was_replaced_is_tried_again() {
    let Some((_one, chrome, page)) = scratch_page(
        "(() => { document.body.innerHTML = '<button id=\"target\">target</button>'; \
           window.targetClicks = 0; window.replaced = false; \
           const count = () => window.targetClicks++; \
           document.querySelector('#target').addEventListener('click', count); \
           document.addEventListener('mousedown', () => { \
             if (window.replaced) return; window.replaced = true; \
             const old = document.querySelector('#target'); const b = old.cloneNode(true); \
             b.addEventListener('click', count); old.replaceWith(b); }); \
           return true; })()",
    )
    .await
    else {
        return;
    };
    click(&page, "#target").await;
    let (clicks, replaced): (u32, bool) = js(&page, "[window.targetClicks, window.replaced]").await;
    assert!(
        replaced,
        "the page never replaced the button under the press"
    );
    assert_eq!(clicks, 1, "the button heard {clicks} clicks");
    chrome.close().await;
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
    let _one = ONE_BROWSER.lock().await;
    let sup = Supervisor::builder().slots(2).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let mut others = Vec::new();
    for _ in 0..leasehold_console::MAX_STREAMS {
        others.push(hold_stream(console.local_addr()).await);
    }
    let chrome = Chrome::launch(&exe, 1280, 1100).await;
    let page = chrome.browser.new_page(console.url()).await.unwrap();
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
    chrome.close().await;
    sup.shutdown().await.unwrap();
}

/// What the button `selector` is armed for: its text, and whether it is armed.
async fn button_state(page: &Page, selector: &str) -> (String, bool) {
    js(
        page,
        &format!(
            "(() => {{ const b = document.querySelector('{selector}'); \
             return [b.textContent, b.dataset.armed === 'true']; }})()"
        ),
    )
    .await
}

/// What a lane's cancel button is armed for: its text, and whether it is armed.
async fn lane_button(page: &Page, slot: u32) -> (String, bool) {
    button_state(page, &format!(".lane[data-slot=\"{slot}\"] .lane-cancel")).await
}

/// A confirmed cancel acts on exactly the job and lease the user confirmed. The scene of the
/// report: a lane's Cancel armed with "confirm cancel of 07-tricorn-c11?"; before the second
/// click the slot passed to another job, and that job was cancelled. Here, on one slot: the
/// button armed for the first holder disarms when the slot passes to the second, so the next
/// click only asks again (naming the second holder and its lease); and a page that still shows
/// the old holder (paused) sends the job and lease confirmed, which the server refuses with
/// `CONSOLE_TARGET_CHANGED`: the slot's new holder is never cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_cancel_acts_on_the_lease_confirmed_and_never_on_the_slots_next_holder() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let outcomes = console.outcomes();
    // One slot: the first holder runs, the second and the third wait in that order.
    let mut first = Gated::submit(&sup, "first-holder");
    let (_, first_lease) = first.started().await;
    let mut second = Gated::submit(&sup, "second-holder");
    queued(&sup, 1).await;
    let mut third = Gated::submit(&sup, "third-holder");
    queued(&sup, 2).await;
    let chrome = Chrome::launch(&exe, 1280, 1000).await;
    let page = chrome.open(&console).await;
    js::<bool>(&page, COUNT_POSTS).await;
    type_into(&page, "#token", TOKEN).await;
    wait_for(
        &page,
        "the first holder's lane with its cancel button",
        &format!(
            "{}?.dataset.lease === '{first_lease}' && !{0}.querySelector('.lane-cancel').hidden",
            lane("first-holder")
        ),
    )
    .await;

    // Armed for the first holder: the question names its job and lease.
    arm(
        &page,
        ".lane[data-slot=\"0\"] .lane-cancel",
        &format!("Confirm: cancel first-holder (lease {first_lease})?"),
    )
    .await;
    // The first holder ends; the slot passes to the second.
    first.open();
    first.join().await.unwrap();
    let (second_token, second_lease) = second.started().await;
    wait_for(
        &page,
        "the slot passed to the second holder",
        &format!(
            "{}?.dataset.lease === '{second_lease}'",
            lane("second-holder")
        ),
    )
    .await;
    // The user clicks again, as they meant to confirm: it must not cancel the second holder.
    click(&page, ".lane[data-slot=\"0\"] .lane-cancel").await;
    wait_for(
        &page,
        "the click answered (a request sent, or the button asking again)",
        "window.__posts.length > 0 || \
         document.querySelector('.lane[data-slot=\"0\"] .lane-cancel').textContent.includes('second-holder')",
    )
    .await;
    assert!(
        posts(&page).await.is_empty() && !second_token.is_cancelled(),
        "the second click cancelled second-holder, a job the user never confirmed (posts: {:?})",
        posts(&page).await
    );
    let (text, armed) = lane_button(&page, 0).await;
    assert!(armed, "{text}");
    assert_eq!(
        text,
        format!("Confirm: cancel second-holder (lease {second_lease})?"),
        "the click after the change of hands only asks, naming the new holder and its lease"
    );

    // A page that does not know yet (paused: it still shows the second holder, armed) sends
    // the job and lease the user confirmed; the server refuses, since that lease has ended.
    ready(&page, ".lane[data-slot=\"0\"] .lane-cancel").await;
    click(&page, "#pause").await;
    second.open();
    second.join().await.unwrap();
    let (third_token, third_lease) = third.started().await;
    click(&page, ".lane[data-slot=\"0\"] .lane-cancel").await;
    wait_for(
        &page,
        "the refusal next to the button: the lease confirmed is no longer the job's",
        "document.querySelector('.lane[data-slot=\"0\"] .lane-result').dataset.status === '409' && \
         document.querySelector('.lane[data-slot=\"0\"] .lane-result').dataset.code === 'CONSOLE_TARGET_CHANGED'",
    )
    .await;
    let sent: Vec<String> = posts(&page).await;
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(
        !third_token.is_cancelled(),
        "the refused cancel reached the slot's new holder"
    );
    assert!(
        vertical_gap(
            &page,
            ".lane[data-slot=\"0\"] .lane-result",
            ".lane[data-slot=\"0\"] .lane-cancel"
        )
        .await
            < 60.0,
        "the answer shows beside the button"
    );
    screenshot(&page, "console-cancel-refused.png").await;

    // Live again: the lane shows the third holder; a cancel confirmed for it cancels it.
    click(&page, "#pause").await;
    wait_for(
        &page,
        "the third holder's lane",
        &format!(
            "{}?.dataset.lease === '{third_lease}'",
            lane("third-holder")
        ),
    )
    .await;
    arm(
        &page,
        ".lane[data-slot=\"0\"] .lane-cancel",
        &format!("Confirm: cancel third-holder (lease {third_lease})?"),
    )
    .await;
    click(&page, ".lane[data-slot=\"0\"] .lane-cancel").await;
    let third_result = third.join().await;
    assert_eq!(
        third_result.as_ref().unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );
    outcomes.record("third-holder", &third_result);
    wait_for(
        &page,
        "the cancel's answer, then how the job ended, beside the button",
        &format!(
            "document.querySelector('.lane[data-slot=\"0\"] .lane-result').textContent.includes(\
               'cancel requested for third-holder (lease {third_lease}); it ended: LEASE_BODY_CANCELLED')"
        ),
    )
    .await;

    chrome.close().await;
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// A lane's cancel button, for the job `job`.
fn cancel_button(job: &str) -> String {
    format!(".lane[data-job=\"{job}\"] .lane-cancel")
}

/// A job of a [`CancelScene`]: running, with its id, its cancellation token and its lease.
struct Running {
    id: &'static str,
    job: Gated,
    token: CancellationToken,
    lease: u64,
}

impl Running {
    /// The question its lane's cancel button asks once armed.
    fn question(&self) -> String {
        format!("Confirm: cancel {} (lease {})?", self.id, self.lease)
    }
}

/// The scene of a cancel test: a supervisor with a slot for each of its jobs, a console whose
/// actions take [`TOKEN`], and its page in a 1280 × 1000 browser, counting its POSTs
/// ([`COUNT_POSTS`]), with the token typed in and every job's cancel button shown. Holds the
/// one-browser lock until [`CancelScene::close`].
struct CancelScene {
    sup: Supervisor,
    /// How many jobs it started (one a slot).
    jobs: usize,
    console: ConsoleHandle,
    chrome: Chrome,
    page: Page,
    _one: tokio::sync::MutexGuard<'static, ()>,
}

/// Sets up a [`CancelScene`] with a [`Gated`] job running for each of `ids` (submitted in that
/// order, each once the last has started); `None` where the browser test is skipped.
async fn cancel_scene<const N: usize>(
    ids: [&'static str; N],
) -> Option<(CancelScene, [Running; N])> {
    let exe = chromium_or_skip()?;
    let one = ONE_BROWSER.lock().await;
    let slots = u32::try_from(N).unwrap();
    let sup = Supervisor::builder().slots(slots).start().await.unwrap();
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let mut jobs = Vec::with_capacity(N);
    for id in ids {
        let mut job = Gated::submit(&sup, id);
        let (token, lease) = job.started().await;
        jobs.push(Running {
            id,
            job,
            token,
            lease,
        });
    }
    let chrome = Chrome::launch(&exe, 1280, 1000).await;
    let page = chrome.open(&console).await;
    js::<bool>(&page, COUNT_POSTS).await;
    type_into(&page, "#token", TOKEN).await;
    let shown: Vec<String> = ids
        .iter()
        .map(|id| format!("!{}?.querySelector('.lane-cancel').hidden", lane(id)))
        .collect();
    wait_for(
        &page,
        &format!("the lanes of {ids:?} with their cancel buttons"),
        &shown.join(" && "),
    )
    .await;
    let jobs = jobs.try_into().unwrap_or_else(|_| unreachable!("{N} jobs"));
    Some((
        CancelScene {
            sup,
            jobs: N,
            console,
            chrome,
            page,
            _one: one,
        },
        jobs,
    ))
}

impl CancelScene {
    /// What `by` did to `job`'s cancel button only armed it: nothing sent, `job` (and every job
    /// of the scene) still running, the button armed and asking its question.
    async fn only_armed(&self, job: &Running, by: &str) {
        let sent = posts(&self.page).await;
        assert!(
            sent.is_empty() && !job.token.is_cancelled(),
            "{by} cancelled {}, a job the user never confirmed (posts: {sent:?})",
            job.id
        );
        assert_eq!(self.sup.stats().active, self.jobs);
        let (text, armed) = button_state(&self.page, &cancel_button(job.id)).await;
        assert!(armed, "{by} left the button unarmed: {text}");
        assert_eq!(text, job.question());
    }

    /// `job` ends `LEASE_BODY_CANCELLED`, and the page has sent `sent` POSTs by then.
    async fn ended_cancelled(&self, job: Running, sent: usize) {
        let result = job.job.join().await;
        assert_eq!(result.unwrap_err().code(), "LEASE_BODY_CANCELLED");
        assert_eq!(posts(&self.page).await.len(), sent);
    }

    async fn close(self) {
        self.chrome.close().await;
        self.console.shutdown().await.unwrap();
        self.sup.shutdown().await.unwrap();
    }
}

/// A double-click on a lane's Cancel only arms it. The report: the second click of a
/// double-click was taken as the confirmation, and the job was cancelled about 100 ms later,
/// before the question could be read. A confirming click must be a separate one (not the rest of
/// a multi-click: `detail` > 1) that comes once the button is ready (half a second after arming,
/// `data-ready`); then a click confirms, and so does the keyboard (Enter: a click of `detail` 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_click_on_cancel_only_arms_it_and_a_later_click_or_key_confirms() {
    let Some((scene, [clicked, keyed])) = cancel_scene(["double-clicked", "keyed"]).await else {
        return;
    };
    let page = &scene.page;

    // ---- a double-click: armed, asking; nothing sent, the job runs ------------------------------
    let button = cancel_button(clicked.id);
    listen_clicks(page, &button).await;
    double_click(page, &button).await;
    let clicks: Vec<i64> = heard(page).await.into_iter().map(|(d, _)| d).collect();
    assert_eq!(
        clicks,
        [1, 2],
        "the button heard both clicks of the double-click"
    );
    // Well past when the double-click's second click would have acted (at once: its cancel
    // reached the supervisor about 100 ms later).
    frames_later(page, 8).await;
    scene.only_armed(&clicked, "a double-click").await;
    screenshot(page, "console-double-click-armed.png").await;

    // ---- a separate click once the button is ready: cancelled ----------------------------------
    ready(page, &button).await;
    click(page, &button).await;
    scene.ended_cancelled(clicked, 1).await;

    // ---- the keyboard: Enter arms; Enter again at once only asks; Enter once ready confirms --
    let button = cancel_button(keyed.id);
    listen_clicks(page, &button).await;
    let key_button = page.find_element(&button).await.unwrap();
    key_button.focus().await.unwrap();
    key_button.press_key("Enter").await.unwrap();
    key_button.press_key("Enter").await.unwrap();
    let keys = heard(page).await;
    assert_eq!(
        keys.iter().map(|(d, _)| *d).collect::<Vec<_>>(),
        [0, 0],
        "Enter on the focused button: two clicks of detail 0"
    );
    frames_later(page, 2).await;
    // The second Enter came before the button was ready (its state then, as the page saw it):
    // it only left the button asking. (On a machine stalled past the half second between the
    // two keys, it would rightly confirm: nothing to check then.)
    if !keys[1].1 {
        let (text, armed) = button_state(page, &button).await;
        assert!(
            armed && posts(page).await.len() == 1 && !keyed.token.is_cancelled(),
            "an Enter before the button was ready confirmed the cancel of keyed ({text})"
        );
        assert_eq!(text, keyed.question());
        ready(page, &button).await;
        key_button.press_key("Enter").await.unwrap();
    } else {
        let _ = writeln!(
            std::io::stderr(),
            "the second Enter came after the button was ready: the early Enter went unchecked"
        );
    }
    scene.ended_cancelled(keyed, 2).await;

    scene.close().await;
}

/// Enter held down on a focused cancel: its first keydown arms the button, and the keyboard's
/// auto-repeat sends keydowns (each a click of the button) for as long as it is held, past the
/// moment the button is ready: none of them confirms (one held press is not a second one).
/// A fresh press of Enter, once the key was released, confirms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holding_enter_on_a_cancel_only_arms_it_and_a_fresh_press_confirms() {
    let Some((scene, [held])) = cancel_scene(["held"]).await else {
        return;
    };
    let page = &scene.page;
    let button = cancel_button(held.id);
    listen_clicks(page, &button).await;
    page.find_element(&button)
        .await
        .unwrap()
        .focus()
        .await
        .unwrap();

    // ---- Enter pressed and held: it arms; its repeats, before and after ready, do not confirm --
    enter(page, Enter::Down).await;
    enter(page, Enter::Repeat).await;
    enter(page, Enter::Repeat).await;
    ready(page, &button).await;
    for _ in 0..3 {
        enter(page, Enter::Repeat).await;
    }
    let keys = heard(page).await;
    assert!(
        keys.len() == 6 && keys.iter().all(|(d, _)| *d == 0),
        "the press and its five repeats: six clicks of detail 0 (heard {keys:?})"
    );
    assert!(
        keys[3].1,
        "the repeats after `ready` reached a ready button (heard {keys:?})"
    );
    frames_later(page, 8).await;
    scene.only_armed(&held, "holding Enter").await;
    enter(page, Enter::Up).await;

    // ---- released, then pressed again: that press confirms ------------------------------------
    ready(page, &button).await;
    enter(page, Enter::Down).await;
    enter(page, Enter::Up).await;
    scene.ended_cancelled(held, 1).await;

    scene.close().await;
}

/// Every action asks to confirm first (Reclaim and Resize acted on the first click), and a
/// control the page hides is not shown (a CSS rule's `display: flex` overrode the `hidden` of
/// the Resize row, on a broker whose capacity cannot be changed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_action_asks_to_confirm_first_and_a_hidden_control_is_not_shown() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;
    let chrome = Chrome::launch(&exe, 1280, 1000).await;

    // ---- a broker that decides its own capacity: no Resize on the page -----------------------
    struct OneSlot(std::sync::atomic::AtomicU64);
    impl leasehold::SlotBroker for OneSlot {
        async fn acquire(
            &self,
            _request: leasehold::AcquireRequest,
        ) -> Result<leasehold::SlotToken, leasehold::BrokerError> {
            let lease = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(leasehold::SlotToken::new(0, lease))
        }
        async fn release(
            &self,
            _token: leasehold::SlotToken,
        ) -> Result<(), leasehold::BrokerError> {
            Ok(())
        }
        fn capacity(&self) -> Option<u32> {
            Some(1)
        }
    }
    let fixed = Supervisor::builder()
        .broker(OneSlot(std::sync::atomic::AtomicU64::new(1)))
        .start()
        .await
        .unwrap();
    let fixed_console = Console::builder(fixed.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let page = chrome.open(&fixed_console).await;
    wait_for(
        &page,
        "the actions shown, the Resize row not",
        "!document.querySelector('#actions').hidden && \
         document.querySelector('#cancel-row').getClientRects().length > 0",
    )
    .await;
    let shown: (String, usize) = js(
        &page,
        "(() => { const r = document.querySelector('#resize-row'); \
         return [getComputedStyle(r).display, r.getClientRects().length]; })()",
    )
    .await;
    assert_eq!(
        shown,
        ("none".to_owned(), 0),
        "the Resize row is hidden, yet shown: resize cannot work on this broker"
    );
    page.close().await.unwrap();
    fixed_console.shutdown().await.unwrap();
    fixed.shutdown().await.unwrap();

    // ---- the in-process pool: each action's first click only asks --------------------------
    let (sup, _root) = support::pool(2).await;
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let (dir_tx, dir_rx) = oneshot::channel();
    let clobbered = sup
        .run(JobSpec::new("clobbered").unwrap(), |ctx| async move {
            let _ = dir_tx.send(support::clobber_temp_dir(&ctx)?);
            Ok::<_, std::io::Error>(())
        })
        .await;
    assert_eq!(clobbered.unwrap_err().code(), "LEASE_CLEANUP_UNCONFIRMED");
    // Reclaimable now: the reclaim would free it, if it were sent.
    std::fs::remove_file(dir_rx.await.unwrap()).unwrap();
    let quarantined = sup.quarantined().await.unwrap();
    let (q_slot, q_lease) = (
        quarantined[0].token.slot_id(),
        quarantined[0].token.lease_id(),
    );
    let mut victim = Gated::submit(&sup, "victim");
    let (victim_token, victim_lease) = victim.started().await;
    let page = chrome.open(&console).await;
    js::<bool>(&page, COUNT_POSTS).await;
    type_into(&page, "#token", TOKEN).await;
    wait_for(
        &page,
        "the quarantined slot and the victim's lane",
        &format!(
            "document.querySelectorAll('#quarantine tbody tr').length === 1 && \
             !document.querySelector('#reclaim-btn').hidden && {}?.dataset.phase === 'running'",
            lane("victim")
        ),
    )
    .await;
    arm(
        &page,
        "#reclaim-btn",
        &format!("Confirm: reclaim slot {q_slot} (lease {q_lease})?"),
    )
    .await;
    type_into(&page, "#resize-slots", "3").await;
    arm(&page, "#resize-btn", "Confirm: resize from 2 to 3 slots?").await;
    type_into(&page, "#cancel-job", "victim").await;
    arm(
        &page,
        "#cancel-btn",
        &format!("Confirm: cancel victim (lease {victim_lease} on slot"),
    )
    .await;
    arm(
        &page,
        ".lane[data-job=\"victim\"] .lane-cancel",
        &format!("Confirm: cancel victim (lease {victim_lease})?"),
    )
    .await;
    frames_later(&page, 5).await;
    assert_eq!(
        posts(&page).await,
        Vec::<String>::new(),
        "a first click acted"
    );
    assert_eq!(sup.stats().quarantined, 1);
    assert_eq!(sup.stats().capacity, Some(2));
    assert!(!victim_token.is_cancelled());
    screenshot(&page, "console-armed.png").await;

    // The second click (within the ten seconds a button stays armed) acts, and answers beside
    // the button.
    click(&page, "#reclaim-btn").await;
    wait_for(
        &page,
        "the reclaim done",
        "document.querySelector('#reclaim-result').dataset.status === '200' && \
         document.querySelector('#reclaim-result').textContent.includes('1 reclaimed') && \
         document.querySelectorAll('#quarantine tbody tr').length === 0",
    )
    .await;
    click(&page, "#resize-btn").await;
    wait_for(
        &page,
        "the resize done",
        "document.querySelector('#resize-result').textContent.includes('capacity 3')",
    )
    .await;
    assert_eq!(sup.stats().capacity, Some(3));
    assert!(!victim_token.is_cancelled());
    victim.open();
    victim.join().await.unwrap();
    chrome.close().await;
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// A page at most this tall (CSS pixels) at 1400 px wide, whatever the history holds.
const MAX_PAGE_HEIGHT_1400: f64 = 2500.0;
/// ... and at 390 px wide (a phone: one column).
const MAX_PAGE_HEIGHT_390: f64 = 5000.0;

/// Answers and details show where the user clicked: a history row's detail opens over the page
/// in view (it opened below a list of 200 rows, 12,564 px down), an action's answer next to its
/// button (it was one line under the Actions section); the history comes in pages, so the page
/// stays short with a thousand job ends (it was 5,000 to 12,000 px tall).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_and_details_show_beside_the_click_and_a_long_history_keeps_the_page_short() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;
    let sup = Supervisor::builder().slots(2).start().await.unwrap();
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let outcomes = console.outcomes();
    for i in 0..1000 {
        let result: Result<(), leasehold::JobError<std::io::Error>> = if i % 7 == 0 {
            Err(leasehold::JobError::Acquire(
                leasehold::AcquireError::Cancelled,
            ))
        } else {
            Ok(())
        };
        outcomes.record(&format!("bake-{i:04}"), &result);
    }
    let mut runner = Gated::submit(&sup, "runner");
    let (_, runner_lease) = runner.started().await;
    let chrome = Chrome::launch(&exe, 1400, 1000).await;
    let page = chrome.open(&console).await;
    js::<bool>(&page, COUNT_POSTS).await;
    type_into(&page, "#token", TOKEN).await;

    // ---- the history in pages, the page short ------------------------------------------------
    wait_for(
        &page,
        "the newest page of the history",
        "document.querySelector('#history-range').textContent === 'rows 1–25 of 1000 job ends' && \
         document.querySelectorAll('#outcomes tbody tr').length === 25 && \
         document.querySelector('#outcomes tbody tr').dataset.job === 'bake-0999'",
    )
    .await;
    wait_for(
        &page,
        "the charts and the timeline drawn",
        "document.querySelectorAll('#charts .chart svg').length === 4 && \
         document.querySelectorAll('#timeline .tl-row').length === 2",
    )
    .await;
    let height: f64 = js(&page, "document.documentElement.scrollHeight").await;
    let _ = writeln!(
        std::io::stderr(),
        "page height at 1400 px with 1000 job ends: {height} px"
    );
    assert!(
        height <= MAX_PAGE_HEIGHT_1400,
        "the page is {height} px tall at 1400 px wide with 1000 job ends"
    );
    screenshot(&page, "console-history-1000.png").await;
    click(&page, "#history-older").await;
    wait_for(
        &page,
        "the next page: rows 26 to 50",
        "document.querySelector('#history-range').textContent === 'rows 26–50 of 1000 job ends' && \
         document.querySelector('#outcomes tbody tr').dataset.job === 'bake-0974' && \
         !document.querySelector('#history-newer').disabled",
    )
    .await;

    // ---- a row's detail opens in view ----------------------------------------------------------
    click(&page, "#outcomes tbody tr:last-child").await;
    wait_for(
        &page,
        "the detail of the row clicked, in view",
        "(() => { const d = document.querySelector('#detail'); const r = d.getBoundingClientRect(); \
           return d.open && d.dataset.job === 'bake-0950' && r.top >= 0 && \
             r.bottom <= window.innerHeight && r.height > 50; })()",
    )
    .await;
    screenshot(&page, "console-history-detail.png").await;
    click(&page, "#detail-close").await;
    click(&page, "#history-newest").await;
    wait_for(
        &page,
        "the newest page again",
        "document.querySelector('#outcomes tbody tr').dataset.job === 'bake-0999'",
    )
    .await;

    // ---- each action's answer beside its button -------------------------------------------------
    type_into(&page, "#resize-slots", "2.5").await;
    click(&page, "#resize-btn").await;
    wait_for(
        &page,
        "a resize to 2.5 refused on the page",
        "document.querySelector('#resize-result').textContent.includes('not a whole number of slots')",
    )
    .await;
    assert!(vertical_gap(&page, "#resize-result", "#resize-btn").await < 40.0);
    type_into(&page, "#cancel-job", "no-such-job").await;
    confirm_click(&page, "#cancel-btn").await;
    wait_for(
        &page,
        "the 404 of a cancel of an unknown job",
        "document.querySelector('#cancel-result').dataset.code === 'CONSOLE_NOT_FOUND'",
    )
    .await;
    assert!(vertical_gap(&page, "#cancel-result", "#cancel-btn").await < 40.0);
    assert_eq!(
        posts(&page).await.len(),
        1,
        "the resize to 2.5 was not sent"
    );
    let runner_slot: String = js(&page, &format!("{}.dataset.slot", lane("runner"))).await;
    let lane_of = |part: &str| format!(".lane[data-slot=\"{runner_slot}\"] {part}");
    arm(
        &page,
        &lane_of(".lane-cancel"),
        &format!("Confirm: cancel runner (lease {runner_lease})?"),
    )
    .await;
    click(&page, &lane_of(".lane-cancel")).await;
    wait_for(
        &page,
        "the lane's cancel answered in its lane",
        &format!(
            "document.querySelector('{}').dataset.status === '200'",
            lane_of(".lane-result")
        ),
    )
    .await;
    // Beside where the button was (the lane's actions: the button goes once the job has ended).
    assert!(vertical_gap(&page, &lane_of(".lane-result"), &lane_of(".lane-actions")).await < 60.0);
    assert_eq!(
        runner.join().await.unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );

    // ---- a phone's width: one column, still bounded --------------------------------------------
    page.execute(SetDeviceMetricsOverrideParams::new(390, 844, 1.0, true))
        .await
        .unwrap();
    wait_for(
        &page,
        "the page within 390 px",
        "window.innerWidth === 390 && document.documentElement.scrollWidth <= 390",
    )
    .await;
    let height: f64 = js(&page, "document.documentElement.scrollHeight").await;
    let _ = writeln!(
        std::io::stderr(),
        "page height at 390 px with 1000 job ends: {height} px"
    );
    assert!(
        height <= MAX_PAGE_HEIGHT_390,
        "the page is {height} px tall at 390 px wide with 1000 job ends"
    );
    chrome.close().await;
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// The queue listing comes about once a second, the lanes ten times a second: a job granted a
/// slot in between was listed as waiting while its lane showed it running. A mutation observer
/// in the page checks every frame as it is applied, while slots pass from job to job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_never_lists_a_job_that_the_same_frame_shows_holding_a_slot() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;
    let sup = Supervisor::builder().slots(2).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let mut jobs: Vec<Gated> = Vec::new();
    for i in 0..12 {
        jobs.push(Gated::submit(&sup, &format!("job-{i:02}")));
        if i < 2 {
            // The first two hold the slots before the others queue, in order.
            jobs[i].started().await;
        }
    }
    let chrome = Chrome::launch(&exe, 1280, 1000).await;
    let page = chrome.open(&console).await;
    wait_for(
        &page,
        "the queue listed",
        "document.querySelectorAll('#waiters tbody tr').length === 8",
    )
    .await;
    js::<bool>(
        &page,
        "(() => { window.__overlap = []; window.__checks = 0; \
           const check = () => { window.__checks += 1; \
             const held = new Set([...document.querySelectorAll('#lanes .lane')] \
               .map(l => l.dataset.job).filter(Boolean)); \
             if (document.querySelector('#waiters').hidden) return; \
             for (const tr of document.querySelectorAll('#waiters tbody tr')) \
               if (held.has(tr.dataset.job)) window.__overlap.push(tr.dataset.job); }; \
           new MutationObserver(check).observe(document.querySelector('main'), \
             { subtree: true, childList: true, attributes: true, characterData: true }); \
           return true; })()",
    )
    .await;
    let holders =
        "[...document.querySelectorAll('#lanes .lane')].map(l => l.dataset.job).filter(Boolean)";
    for _ in 0..8 {
        // One holder ends; a waiting job is granted its slot.
        let before: Vec<String> = js(&page, holders).await;
        let ending: usize = before[0][4..].parse().unwrap();
        jobs[ending].open();
        wait_for(
            &page,
            &format!("a waiting job granted {ending}'s slot"),
            &format!(
                "{holders}.length === 2 && {holders}.every(j => j !== 'job-{ending:02}') && \
                 {holders}.some(j => !{before:?}.includes(j))"
            ),
        )
        .await;
        frames_later(&page, 3).await;
    }
    let (overlap, checks): (Vec<String>, u64) =
        js(&page, "[window.__overlap, window.__checks]").await;
    assert!(checks > 20, "the observer saw {checks} changes");
    assert!(
        overlap.is_empty(),
        "the queue listed jobs that the same frame showed holding a slot: {overlap:?}"
    );
    chrome.close().await;
    for mut job in jobs {
        if job.gate.is_some() {
            job.open();
        }
        job.join().await.unwrap();
    }
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// Captures, in the page, the last `/api/timeline` answer it fetched: `window.__tl`.
const CAPTURE_TIMELINE: &str = "(() => { if (!window.__tlWrapped) { window.__tlWrapped = true; \
    const f = window.fetch; window.fetch = async (url, init) => { const res = await f(url, init); \
    if (String(url).startsWith('api/timeline') && res.ok) window.__tl = await res.clone().json(); \
    return res; }; } return true; })()";

/// The charts can be read, as drawn (the SVG itself is read): a time axis ending at "now", a
/// y scale from 0, a legend that tells p50 from p99 in the series' own colours, "now" the last
/// second that has ended (it was the second in progress: "throughput now 0" while jobs ended at
/// 2 a second), and a lone value drawn as a dot (a one-point line was invisible).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_show_a_time_axis_a_scale_a_legend_the_last_complete_second_and_lone_values() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;
    let sup = Supervisor::builder().slots(4).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let chrome = Chrome::launch(&exe, 1280, 1000).await;
    let page = chrome.open(&console).await;
    js::<bool>(&page, CAPTURE_TIMELINE).await;

    // One job drains (its tracked task holds the slot after its body): one drain value.
    let (task_gate, task_rx) = oneshot::channel::<()>();
    let drained = sup.submit(JobSpec::new("drained").unwrap(), move |ctx| async move {
        drop(ctx.spawn(async move {
            let _ = task_rx.await;
        }));
        Ok::<_, std::io::Error>(())
    });
    wait_for(
        &page,
        "the job draining",
        &format!("{}?.dataset.phase === 'draining'", lane("drained")),
    )
    .await;
    task_gate.send(()).unwrap();
    tokio::time::timeout(JOB_WAIT, drained.join())
        .await
        .unwrap()
        .unwrap();
    // Its drain is one value, a dot; the burst below comes two seconds later, so that it
    // stays alone whatever the burst's own drains.
    wait_for(
        &page,
        "the drain drawn as a dot",
        "document.querySelector('.chart[data-chart=\"drain\"] svg circle') !== null",
    )
    .await;
    let drain_s: u64 = js(
        &page,
        "(() => { const c = window.__tl.charts; \
           return c.from_s + c.drain_p99_ms.findIndex(v => v !== null); })()",
    )
    .await;
    wait_for(
        &page,
        "two more complete seconds",
        &format!("window.__tl.charts.now_s - 1 >= {}", drain_s + 2),
    )
    .await;

    // Three jobs end together, seen running first (the charts count the ends the console
    // sees): a second or two with ends in them, one of them with at least two.
    let mut burst: Vec<Gated> = (0..3)
        .map(|i| Gated::submit(&sup, &format!("burst-{i}")))
        .collect();
    for job in &mut burst {
        job.started().await;
    }
    wait_for(
        &page,
        "the three running",
        "[0, 1, 2].every(i => document.querySelector(`.lane[data-job=\"burst-${i}\"]`)?.dataset.phase === 'running')",
    )
    .await;
    for job in &mut burst {
        job.open();
    }
    for job in burst {
        job.join().await.unwrap();
    }

    // "now" is the last complete second: the drawn caption says the value the data has for
    // the second the axis calls "now", in a drawing whose "now" holds the burst's ends.
    let throughput = ".chart[data-chart=\"throughput\"]";
    wait_for(
        &page,
        "the throughput's now: the ends of the last complete second",
        &format!(
            "(() => {{ const tl = window.__tl; if (!tl) return false; const c = tl.charts; \
               const svg = document.querySelector('{throughput} svg'); \
               if (svg.dataset.nowS !== String(c.now_s - 1)) return false; \
               const v = c.throughput[c.now_s - 1 - c.from_s]; \
               return v >= 2 && document.querySelector('{throughput} .chart-now').textContent === ' · now ' + v; }})()"
        ),
    )
    .await;
    let served: (u64, u64, usize) = js(
        &page,
        "[window.__tl.charts.from_s, window.__tl.charts.now_s, window.__tl.charts.throughput.length]",
    )
    .await;
    assert_eq!(
        served.0 + served.2 as u64,
        served.1,
        "the charts' data end at the last complete second: {served:?}"
    );
    screenshot(&page, "console-charts.png").await;

    // Every chart: a time axis to "now", a y scale from 0 up to at least its largest value.
    let axes: Vec<(String, Vec<String>, Vec<String>, f64)> = js(
        &page,
        "[...document.querySelectorAll('#charts .chart')].map(c => [c.dataset.chart, \
           [...c.querySelectorAll('svg text.x-tick')].map(t => t.textContent), \
           [...c.querySelectorAll('svg text.y-tick')].map(t => t.textContent), \
           Number(c.querySelector('svg').dataset.max)])",
    )
    .await;
    assert_eq!(axes.len(), 4, "{axes:?}");
    for (chart, x, y, max) in &axes {
        assert!(
            x.len() >= 3 && x.last().map(String::as_str) == Some("now") && x[0].starts_with('−'),
            "{chart}: time axis {x:?}"
        );
        assert!(
            y.len() >= 2 && (y[0] == "0" || y[0] == "0.0 s") && *max >= 1.0,
            "{chart}: y scale {y:?} up to {max}"
        );
    }
    // The throughput's scale reaches its largest value.
    let (max, top): (f64, f64) = js(
        &page,
        "[Number(document.querySelector('.chart[data-chart=\"throughput\"] svg').dataset.max), \
          Math.max(...window.__tl.charts.throughput)]",
    )
    .await;
    assert!(max >= top, "the scale tops at {max}, a value is {top}");

    // The legend tells p50 from p99 in the colours their series are drawn in.
    let legend: Vec<(String, String)> = js(
        &page,
        "[...document.querySelectorAll('.chart[data-chart=\"wait\"] svg line.key')].map((l, i) => \
           [document.querySelectorAll('.chart[data-chart=\"wait\"] svg text.key')[i].textContent, \
            getComputedStyle(l).stroke])",
    )
    .await;
    assert_eq!(
        legend,
        [
            ("p50".to_owned(), "rgb(70, 130, 180)".to_owned()),
            ("p99".to_owned(), "rgb(230, 85, 13)".to_owned())
        ]
    );
    // A series is drawn in its legend's colour.
    let drawn: Vec<String> = js(
        &page,
        "[...document.querySelectorAll('#charts svg :is(polyline, circle).series-0')] \
           .map(e => getComputedStyle(e).stroke)",
    )
    .await;
    assert!(
        !drawn.is_empty() && drawn.iter().all(|c| c == "rgb(70, 130, 180)"),
        "{drawn:?}"
    );

    // Each lone value (no value in the second before or after) is a dot one can see.
    let lone: Vec<(String, usize, usize, f64)> = js(
        &page,
        "(() => { const c = window.__tl.charts; const keys = { throughput: ['throughput'], \
             queue: ['queue'], wait: ['wait_p50_ms', 'wait_p99_ms'], drain: ['drain_p99_ms'] }; \
           return Object.entries(keys).map(([chart, series]) => { \
             const lone = series.map(k => c[k].filter((v, i, a) => v !== null && \
               (i === 0 || a[i - 1] === null) && (i === a.length - 1 || a[i + 1] === null)).length) \
               .reduce((a, b) => a + b, 0); \
             const dots = [...document.querySelectorAll(`.chart[data-chart=\"${chart}\"] svg circle`)]; \
             return [chart, lone, dots.length, Math.min(99, ...dots.map(d => d.getBBox().width))]; }); })()",
    )
    .await;
    let drain = lone.iter().find(|l| l.0 == "drain").unwrap();
    assert!(drain.1 >= 1, "the drain chart has a lone value: {lone:?}");
    for (chart, values, dots, width) in &lone {
        assert_eq!(values, dots, "{chart}: every lone value a dot: {lone:?}");
        if *dots > 0 {
            assert!(*width >= 4.0, "{chart}: a dot {width} units wide");
        }
    }
    chrome.close().await;
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// An embedder's word on a job shows in the history: render_farm's SKIPPED was shown as OK,
/// because `Outcomes::record` takes only the `Result`. And the history's text reads right: a
/// code breaks between its words at a phone's width ("LEASE_BODY_FAILE / D"), an error is one
/// phrase ("job failed: job body failed: ..."), a finished job "ended while running" (not
/// "last seen running"), and a job too short to be sampled shows the slot its body saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedders_label_and_note_show_in_the_history_and_its_text_reads_right() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let outcomes = console.outcomes();
    // A frame already rendered: the body returns early, Ok; the embedder says SKIPPED.
    let skipped = sup
        .run(JobSpec::new("frame-skipped").unwrap(), |ctx| async move {
            Ok::<_, std::io::Error>((ctx.slot_id(), ctx.lease_id()))
        })
        .await;
    let (slot, lease) = *skipped.as_ref().unwrap();
    outcomes.record_with(
        "frame-skipped",
        &skipped,
        JobNote::new()
            .label("SKIPPED")
            .unwrap()
            .note("frames/mandel.png already rendered")
            .slot(slot)
            .lease(lease),
    );
    let broken = sup
        .run(JobSpec::new("frame-broken").unwrap(), |_ctx| async {
            Err::<(), _>(std::io::Error::other("scene file: line 3: unknown formula"))
        })
        .await;
    outcomes.record("frame-broken", &broken);
    let chrome = Chrome::launch(&exe, 1280, 1000).await;
    let page = chrome.open(&console).await;
    // A job the console sees running, then ending.
    let mut observed = Gated::submit(&sup, "observed");
    observed.started().await;
    wait_for(
        &page,
        "the observed job running",
        &format!("{}?.dataset.phase === 'running'", lane("observed")),
    )
    .await;
    observed.open();
    let result = observed.join().await;
    outcomes.record("observed", &result);

    let row = |job: &str, cell: &str| {
        format!("document.querySelector('#outcomes tbody tr[data-job=\"{job}\"] td.{cell}')")
    };
    wait_for(
        &page,
        "the three rows",
        &format!(
            "{}?.textContent === 'SKIPPED' && {}?.textContent === 'LEASE_BODY_FAILED' && \
             {}?.textContent === 'OK'",
            row("frame-skipped", "code"),
            row("frame-broken", "code"),
            row("observed", "code")
        ),
    )
    .await;
    let skipped_row: Vec<String> = js(
        &page,
        &format!(
            "[...document.querySelectorAll('#outcomes tbody tr[data-job=\"frame-skipped\"] td')] \
               .map(td => td.textContent).concat([{}.title])",
            row("frame-skipped", "code")
        ),
    )
    .await;
    assert_eq!(skipped_row[2], "SKIPPED", "{skipped_row:?}");
    assert_eq!(skipped_row[3], slot.to_string(), "the slot its body saw");
    assert!(
        skipped_row[5].contains("frames/mandel.png already rendered"),
        "{skipped_row:?}"
    );
    assert!(skipped_row[6].contains("code OK"), "{skipped_row:?}");
    let broken_detail: String = js(
        &page,
        &format!("{}.textContent", row("frame-broken", "detail")),
    )
    .await;
    assert!(
        broken_detail.starts_with("scene file: line 3: unknown formula")
            && !broken_detail.contains("job failed")
            && !broken_detail.contains("job body failed"),
        "one phrase per error: {broken_detail:?}"
    );
    let observed_detail: String =
        js(&page, &format!("{}.textContent", row("observed", "detail"))).await;
    assert!(
        observed_detail.contains("ended while ") && !observed_detail.contains("last seen"),
        "{observed_detail:?}"
    );
    // The skipped job's detail: its label, its code, its note.
    click(&page, "#outcomes tbody tr[data-job=\"frame-skipped\"]").await;
    wait_for(
        &page,
        "the skipped job's detail",
        "document.querySelector('#detail').open && \
         document.querySelector('#detail').textContent.includes('labelSKIPPED') && \
         document.querySelector('#detail').textContent.includes('codeOK')",
    )
    .await;
    click(&page, "#detail-close").await;
    // The filter by code finds a label.
    type_into(&page, "#history-code", "SKIPPED").await;
    wait_for(
        &page,
        "the history filtered by the label",
        "[...document.querySelectorAll('#outcomes tbody tr')].map(tr => tr.dataset.job).join() === 'frame-skipped'",
    )
    .await;
    clear(&page, "#history-code").await;

    // A phone's width: a code breaks only between its words.
    page.execute(SetDeviceMetricsOverrideParams::new(390, 844, 1.0, true))
        .await
        .unwrap();
    wait_for(
        &page,
        "the page within 390 px, the code on more than one line",
        &format!(
            "window.innerWidth === 390 && {0} && {0}.getBoundingClientRect().height > 30",
            row("frame-broken", "code")
        ),
    )
    .await;
    let pieces: Vec<(String, usize)> = js(
        &page,
        &format!(
            "[...{}.childNodes].filter(n => n.nodeType === 3).map(n => {{ \
               const r = document.createRange(); r.selectNodeContents(n); \
               return [n.textContent, r.getClientRects().length]; }})",
            row("frame-broken", "code")
        ),
    )
    .await;
    screenshot(&page, "console-history-390px.png").await;
    assert!(
        pieces.iter().all(|(_, lines)| *lines == 1),
        "a word of the code broke across lines: {pieces:?}"
    );
    chrome.close().await;
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// README's screenshots, of today's page: a render farm's moment, at 1400 px and at 390 px
/// wide. Always written to `target/tmp/console-browser/readme-*.png`; with
/// `LEASEHOLD_UPDATE_DOCS=1`, also to `console/docs/console.png` and
/// `console/docs/console-390px.png`, which README shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_screenshots_show_todays_page_at_1400_and_390_px() {
    let Some(exe) = chromium_or_skip() else {
        return;
    };
    let _one = ONE_BROWSER.lock().await;
    let (sup, _root) = support::pool(4).await;
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let outcomes = console.outcomes();
    let chrome = Chrome::launch(&exe, 1400, 1000).await;
    let page = chrome.open(&console).await;

    // The first frames of the run: four render while four wait (the wait chart), then those
    // four: one is cancelled, one was rendered already (the embedder says SKIPPED).
    let mut first: Vec<Gated> = ["01-mandelbrot", "02-julia", "03-burning-ship", "04-tricorn"]
        .iter()
        .map(|scene| Gated::submit(&sup, &format!("frame-{scene}")))
        .collect();
    for job in &mut first {
        job.started().await;
    }
    let mut next: Vec<Gated> = Vec::new();
    for scene in ["05-bad-formula", "06-julia-deep", "07-spiral", "08-skipped"] {
        next.push(Gated::submit(&sup, &format!("frame-{scene}")));
        queued(&sup, next.len()).await;
    }
    wait_for(
        &page,
        "four frames waiting",
        "document.querySelectorAll('#waiters tbody tr').length === 4",
    )
    .await;
    for (i, mut job) in first.into_iter().enumerate() {
        job.open();
        let id = job.handle.job_id().to_owned();
        let result = job.join().await;
        outcomes.record(&id, &result);
        let (_, lease) = next[i].started().await;
        next[i].gate.as_ref().expect("not opened yet");
        wait_for(
            &page,
            "the next frame running",
            &format!(
                "{}?.dataset.lease === '{lease}'",
                lane(next[i].handle.job_id())
            ),
        )
        .await;
        // Half a second of frames between two ends, so that the charts have a shape.
        frames_later(&page, 5).await;
    }
    for (i, mut job) in next.into_iter().enumerate() {
        let id = job.handle.job_id().to_owned();
        if i == 0 {
            job.handle.cancel();
        } else {
            job.open();
        }
        let result = job.join().await;
        let note = if i == 3 {
            JobNote::new()
                .label("SKIPPED")
                .unwrap()
                .note("frames/08-skipped.png already rendered")
        } else {
            JobNote::new()
        };
        outcomes.record_with(&id, &result, note);
        frames_later(&page, 5).await;
    }
    // A frame whose slot drains while its GPU read-back task ends.
    let (task_gate, task_rx) = oneshot::channel::<()>();
    let drained = sup.submit(
        JobSpec::new("frame-09-julia-zoom").unwrap(),
        move |ctx| async move {
            drop(ctx.spawn(async move {
                let _ = task_rx.await;
            }));
            Ok::<_, std::io::Error>(())
        },
    );
    wait_for(
        &page,
        "the frame draining",
        &format!(
            "{}?.dataset.phase === 'draining'",
            lane("frame-09-julia-zoom")
        ),
    )
    .await;
    task_gate.send(()).unwrap();
    let result = drained.join().await;
    outcomes.record("frame-09-julia-zoom", &result);
    let broken = sup
        .run(JobSpec::new("frame-10-bad-scene").unwrap(), |_ctx| async {
            Err::<(), _>(std::io::Error::other(
                "scene file: line 3: unknown formula `tricorn2`",
            ))
        })
        .await;
    outcomes.record("frame-10-bad-scene", &broken);

    // Now: one slot quarantined, one running, one draining (its tracked task), one running;
    // three frames wait.
    let clobbered = sup
        .run(
            JobSpec::new("frame-11-clobbered").unwrap(),
            |ctx| async move {
                support::clobber_temp_dir(&ctx)?;
                Ok::<_, std::io::Error>(())
            },
        )
        .await;
    outcomes.record("frame-11-clobbered", &clobbered);
    let mut running = Gated::submit(&sup, "frame-12-tricorn");
    running.started().await;
    let (task_gate, task_rx) = oneshot::channel::<()>();
    let draining = sup.submit(
        JobSpec::new("frame-13-julia").unwrap(),
        move |ctx| async move {
            drop(ctx.spawn(async move {
                let _ = task_rx.await;
            }));
            Ok::<_, std::io::Error>(())
        },
    );
    let mut second = Gated::submit(&sup, "frame-14-mandelbrot-deep");
    second.started().await;
    let waiting: Vec<Gated> = (15..18)
        .map(|i| Gated::submit(&sup, &format!("frame-{i}-spiral")))
        .collect();
    type_into(&page, "#token", TOKEN).await;
    wait_for(
        &page,
        "the farm's moment: quarantine with its reason, a drain, a queue, charts",
        &format!(
            "document.querySelector('#quarantine tbody tr .reason')?.textContent.includes('could not be removed') && \
             {}?.dataset.phase === 'draining' && \
             document.querySelectorAll('#waiters tbody tr').length === 3 && \
             document.querySelectorAll('.chart[data-chart=\"wait\"] svg :is(polyline, circle)').length >= 1 && \
             document.querySelectorAll('.chart[data-chart=\"drain\"] svg :is(polyline, circle)').length >= 1 && \
             document.querySelectorAll('#timeline rect').length >= 10",
            lane("frame-13-julia")
        ),
    )
    .await;
    let wide = screenshot(&page, "readme-1400.png").await;
    page.execute(SetDeviceMetricsOverrideParams::new(390, 844, 1.0, true))
        .await
        .unwrap();
    wait_for(
        &page,
        "the page within 390 px",
        "window.innerWidth === 390 && document.documentElement.scrollWidth <= 390",
    )
    .await;
    let narrow = screenshot(&page, "readme-390.png").await;
    if std::env::var("LEASEHOLD_UPDATE_DOCS").as_deref() == Ok("1") {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
        std::fs::copy(&wide, docs.join("console.png")).unwrap();
        std::fs::copy(&narrow, docs.join("console-390px.png")).unwrap();
        let _ = writeln!(std::io::stderr(), "wrote {}", docs.display());
    }

    chrome.close().await;
    task_gate.send(()).unwrap();
    draining.join().await.unwrap();
    for mut job in [running, second].into_iter().chain(waiting) {
        job.open();
        job.join().await.unwrap();
    }
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}
