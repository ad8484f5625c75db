//! What the farm records about every job, the live progress display, and the timing broker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use leasehold::{
    AcquireRequest, BrokerError, LeaseInfo, LeasePhase, LocalBroker, SlotBroker, SlotToken,
};

/// The instants of one job, from the caller's `run` to the broker's release.
#[derive(Debug, Clone, Default)]
pub struct JobRecord {
    pub id: String,
    pub scene_file: String,
    pub called: Option<Instant>,
    pub body_start: Option<Instant>,
    pub submitted: Option<Instant>,
    pub gpu_done: Option<Instant>,
    /// The queue had completed everything submitted on it before the body ended (what the
    /// lease's release fence waits for, other slots' work included).
    pub queue_done: Option<Instant>,
    pub body_end: Option<Instant>,
    pub release_start: Option<Instant>,
    pub release_end: Option<Instant>,
    pub returned: Option<Instant>,
    /// When the caller cancelled the job's token.
    pub cancel_requested: Option<Instant>,
    pub slot: Option<u32>,
    pub lease: Option<u64>,
    /// `OK`, `SKIPPED` or the leasehold error code.
    pub outcome: String,
    pub note: String,
}

fn ms(from: Option<Instant>, to: Option<Instant>) -> Option<f64> {
    Some(to?.checked_duration_since(from?)?.as_secs_f64() * 1e3)
}

impl JobRecord {
    /// Calling `run` → the body starting.
    pub fn wait_ms(&self) -> Option<f64> {
        ms(self.called, self.body_start)
    }
    /// Body start → body end.
    pub fn run_ms(&self) -> Option<f64> {
        ms(self.body_start, self.body_end)
    }
    /// Body end → the broker release starting: the worker's physical end, the GPU fence, the
    /// temp dir's removal.
    pub fn drain_ms(&self) -> Option<f64> {
        ms(self.body_end, self.release_start)
    }
    /// When the GPU work the release fence waits for had completed: the later of this job's
    /// own submission and everything queued on the device before its body ended.
    pub fn gpu_idle(&self) -> Option<Instant> {
        match (self.gpu_done, self.queue_done) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
    /// The part of the drain spent waiting for the GPU (0 when it was idle at the body's end).
    pub fn gpu_wait_ms(&self) -> Option<f64> {
        let idle = self.gpu_idle()?.min(self.release_start?);
        ms(self.body_end, Some(idle)).or(Some(0.0))
    }
    /// The broker release itself.
    pub fn release_ms(&self) -> Option<f64> {
        ms(self.release_start, self.release_end)
    }
}

/// Shared by the caller's tasks, the job bodies, GPU callbacks and the broker.
pub struct Farm {
    pub t0: Instant,
    jobs: Mutex<Vec<JobRecord>>,
    leases: Mutex<HashMap<u64, usize>>,
    adapter: Mutex<Option<String>>,
    progress: Progress,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Farm {
    pub fn new(jobs: Vec<(String, String)>, progress: Progress) -> Arc<Self> {
        let jobs = jobs
            .into_iter()
            .map(|(id, scene_file)| JobRecord {
                id,
                scene_file,
                ..JobRecord::default()
            })
            .collect();
        Arc::new(Self {
            t0: Instant::now(),
            jobs: Mutex::new(jobs),
            leases: Mutex::new(HashMap::new()),
            adapter: Mutex::new(None),
            progress,
        })
    }

    pub fn records(&self) -> Vec<JobRecord> {
        lock(&self.jobs).clone()
    }

    pub fn adapter(&self) -> Option<String> {
        lock(&self.adapter).clone()
    }

    pub fn set_adapter(&self, info: &leasehold::wgpu::AdapterInfo) {
        lock(&self.adapter).get_or_insert_with(|| {
            format!(
                "{} ({:?}, {:?}, driver {} {})",
                info.name, info.backend, info.device_type, info.driver, info.driver_info
            )
        });
    }

    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    fn update_queue(&self, jobs: &[JobRecord]) {
        let waiting: Vec<&str> = jobs
            .iter()
            .filter(|j| j.called.is_some() && j.body_start.is_none() && j.returned.is_none())
            .map(|j| j.id.as_str())
            .collect();
        self.progress.queue(&waiting);
    }

    /// The caller is about to call `run`.
    pub fn called(&self, job: usize) {
        let mut jobs = lock(&self.jobs);
        jobs[job].called = Some(Instant::now());
        self.update_queue(&jobs);
    }

    pub fn body_started(&self, job: usize, slot: u32, lease: u64) {
        let mut jobs = lock(&self.jobs);
        let j = &mut jobs[job];
        j.body_start = Some(Instant::now());
        j.slot = Some(slot);
        j.lease = Some(lease);
        self.progress
            .slot(slot, &j.id, "rendering: parsing the scene");
        lock(&self.leases).insert(lease, job);
        self.update_queue(&jobs);
    }

    /// A rendering phase inside the body.
    pub fn phase(&self, job: usize, phase: &str) {
        let jobs = lock(&self.jobs);
        if let Some(slot) = jobs[job].slot {
            self.progress.slot(slot, &jobs[job].id, phase);
        }
    }

    pub fn submitted(&self, job: usize) {
        lock(&self.jobs)[job].submitted = Some(Instant::now());
        self.phase(job, "rendering: GPU computing");
    }

    /// From the queue's `on_submitted_work_done` callback: everything submitted on the queue up
    /// to this job's submission has completed.
    pub fn gpu_done(&self, job: usize) {
        lock(&self.jobs)[job]
            .gpu_done
            .get_or_insert_with(Instant::now);
    }

    /// From a queue callback registered when the body ended.
    pub fn queue_done(&self, job: usize) {
        let mut jobs = lock(&self.jobs);
        let j = &mut jobs[job];
        j.queue_done.get_or_insert_with(Instant::now);
        if j.release_start.is_none()
            && let Some(slot) = j.slot
        {
            self.progress.slot(
                slot,
                &j.id,
                "cleaning: GPU fence passed, removing the temp dir",
            );
        }
    }

    pub fn body_ended(&self, job: usize) {
        let mut jobs = lock(&self.jobs);
        let j = &mut jobs[job];
        j.body_end = Some(Instant::now());
        if let Some(slot) = j.slot
            && j.queue_done.is_none()
        {
            let phase = if j.submitted.is_some() && j.gpu_done.is_none() {
                "waiting for the GPU: body ended, its GPU work is still running"
            } else {
                "waiting for the GPU fence, then cleaning"
            };
            self.progress.slot(slot, &j.id, phase);
        }
    }

    fn by_lease(&self, token: SlotToken) -> Option<usize> {
        lock(&self.leases).get(&token.lease_id()).copied()
    }

    pub fn release_started(&self, token: SlotToken) {
        let now = Instant::now();
        if let Some(job) = self.by_lease(token) {
            let mut jobs = lock(&self.jobs);
            jobs[job].release_start = Some(now);
            self.progress
                .slot(token.slot_id(), &jobs[job].id, "releasing (broker)");
        }
    }

    pub fn release_finished(&self, token: SlotToken) {
        let now = Instant::now();
        if let Some(job) = self.by_lease(token) {
            lock(&self.jobs)[job].release_end = Some(now);
            self.progress.idle(token.slot_id());
        }
    }

    /// `run` has returned.
    pub fn returned(&self, job: usize, outcome: &str, note: String) {
        let line = {
            let mut jobs = lock(&self.jobs);
            let j = &mut jobs[job];
            j.returned = Some(Instant::now());
            j.outcome = outcome.to_string();
            j.note = note;
            self.update_queue(&jobs);
            let j = &jobs[job];
            format!(
                "[{:>7.3} s] {:<22} {:<22} slot {}  {}",
                self.t0.elapsed().as_secs_f64(),
                j.id,
                j.outcome,
                j.slot.map_or("-".into(), |s| s.to_string()),
                j.note
            )
        };
        self.progress.job_done(line);
    }

    pub fn cancel_requested(&self, job: usize) {
        lock(&self.jobs)[job].cancel_requested = Some(Instant::now());
    }

    pub fn log(&self, line: &str) {
        self.progress.log(format!(
            "[{:>7.3} s] {line}",
            self.t0.elapsed().as_secs_f64()
        ));
    }
}

/// One line per slot, a line for the queue and an overall bar; all hidden (and plain log lines
/// instead) when stdout is not a terminal.
///
/// The slot lines are drawn from the supervisor's lease table (`Supervisor::leases`), read every
/// 100 ms as a game's debug overlay would read it every frame: who holds the slot, for how long,
/// and, once the body has ended, what the slot's release still waits for. While the body runs,
/// the line shows the body's own progress, which only the job knows.
pub struct Progress {
    multi: Option<MultiProgress>,
    slots: Vec<ProgressBar>,
    /// The body's own progress per slot (reported by the job).
    body: Mutex<Vec<String>>,
    queue: ProgressBar,
    overall: ProgressBar,
}

impl Progress {
    pub fn new(slots: u32, jobs: u64, live: bool) -> Self {
        if !live {
            return Self {
                multi: None,
                slots: (0..slots).map(|_| ProgressBar::hidden()).collect(),
                body: Mutex::new(vec![String::new(); slots as usize]),
                queue: ProgressBar::hidden(),
                overall: ProgressBar::hidden(),
            };
        }
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stdout());
        let line = ProgressStyle::with_template("{spinner} {prefix:<8} {wide_msg}")
            .expect("a valid template")
            .tick_chars("-\\|/ ");
        let slots: Vec<ProgressBar> = (0..slots)
            .map(|s| {
                let pb = multi.add(ProgressBar::new_spinner().with_style(line.clone()));
                pb.set_prefix(format!("slot {s}"));
                pb.set_message("idle");
                pb.enable_steady_tick(Duration::from_millis(120));
                pb
            })
            .collect();
        let queue = multi.add(ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("  {prefix:<8} {wide_msg}").expect("a valid template"),
        ));
        queue.set_prefix("queue");
        queue.set_message("-");
        let overall = multi.add(
            ProgressBar::new(jobs).with_style(
                ProgressStyle::with_template(
                    "  {prefix:<8} [{bar:40}] {pos}/{len} jobs  {elapsed}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            ),
        );
        overall.set_prefix("overall");
        overall.enable_steady_tick(Duration::from_millis(250));
        Self {
            multi: Some(multi),
            body: Mutex::new(vec![String::new(); slots.len()]),
            slots,
            queue,
            overall,
        }
    }

    fn slot(&self, slot: u32, _job: &str, phase: &str) {
        if let Some(text) = lock(&self.body).get_mut(slot as usize) {
            phase.clone_into(text);
        }
    }

    fn idle(&self, slot: u32) {
        if let Some(text) = lock(&self.body).get_mut(slot as usize) {
            text.clear();
        }
    }

    /// Redraws the slot lines from a snapshot of the lease table.
    pub fn show_leases(&self, leases: &[LeaseInfo]) {
        if self.multi.is_none() {
            return;
        }
        let body = lock(&self.body);
        for (slot, pb) in self.slots.iter().enumerate() {
            let Some(lease) = leases.iter().find(|l| l.slot_id as usize == slot) else {
                pb.set_message("idle");
                continue;
            };
            let job = lease.job_id.as_deref().unwrap_or("(lease)");
            let held = lease.held_for.as_secs_f64();
            let what = match lease.phase {
                LeasePhase::Running => body[slot].clone(),
                phase => {
                    let waits: Vec<String> =
                        lease.waiting_for.iter().map(ToString::to_string).collect();
                    format!("{phase:?}: waiting for {}", waits.join(", ")).to_lowercase()
                }
            };
            let line = format!("{job:<22} {held:5.1} s  {what}");
            pb.set_message(line);
        }
    }

    fn queue(&self, waiting: &[&str]) {
        let msg = match waiting {
            [] => "no job waiting for a slot".to_string(),
            [a] => format!("1 waiting for a slot: {a}"),
            [a, b] => format!("2 waiting for a slot: {a}, {b}"),
            [a, b, rest @ ..] => format!(
                "{} waiting for a slot: {a}, {b} and {} more",
                waiting.len(),
                rest.len()
            ),
        };
        self.queue.set_message(msg);
    }

    fn job_done(&self, line: String) {
        self.overall.inc(1);
        self.log(line);
    }

    /// Prints a line above the bars (or plainly when they are hidden); clipped to 150
    /// characters while the bars are live, so that it does not wrap under them.
    pub fn println(&self, line: String) {
        match &self.multi {
            Some(multi) => {
                let clipped = match line.char_indices().nth(150) {
                    Some((cut, _)) => format!("{}...", &line[..cut]),
                    None => line,
                };
                let _ = multi.println(clipped);
            }
            None => println!("{line}"),
        }
    }

    fn log(&self, line: String) {
        self.println(line);
    }

    /// Removes the bars before the summary is printed.
    pub fn finish(&self) {
        for pb in self.slots.iter().chain([&self.queue, &self.overall]) {
            pb.finish_and_clear();
        }
        if let Some(multi) = &self.multi {
            let _ = multi.clear();
        }
    }
}

/// `LocalBroker`, timed: records when each lease's broker release starts and ends. Shows that
/// any `SlotBroker` can stand in for the built-in one.
pub struct TimingBroker {
    inner: LocalBroker,
    farm: Arc<Farm>,
}

impl TimingBroker {
    pub fn new(slots: u32, farm: Arc<Farm>) -> Self {
        Self {
            inner: LocalBroker::new(slots),
            farm,
        }
    }
}

impl SlotBroker for TimingBroker {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.inner.acquire(request).await
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.farm.release_started(token);
        let result = self.inner.release(token).await;
        self.farm.release_finished(token);
        result
    }

    fn capacity(&self) -> Option<u32> {
        self.inner.capacity()
    }
}
