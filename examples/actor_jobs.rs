//! Job actors: an engine's own ractor actors hold slots for exactly their lifetime.
//!
//! A scene loader (an ordinary ractor actor) loads a scene of six assets. Each asset is loaded
//! by a job actor spawned through `Supervisor::spawn_job` on a pool of 2 slots, so at most two
//! load at once and the rest wait in the supervisor's FIFO queue. One asset's loader panics in
//! its handler; another is cancelled mid-work while stuck in a long handler, so the stop cannot
//! reach it and it is killed after the cancel grace. Each line says when an actor's state was
//! dropped and when its slot came back: a slot always comes back after the state is gone.
//!
//! A shader-cache warmer asks the supervisor's lease desk for a slot by message; its lease goes
//! back when it stops, with no explicit release.
//!
//! Run: `cargo run --example actor_jobs`

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use leasehold::ractor::{Actor, ActorProcessingErr, ActorRef, call};
use leasehold::{ActorLease, JobSpec, LeaseMsg, Supervisor, WorkerContext};

static T0: OnceLock<Instant> = OnceLock::new();

/// Prints a line with the time since the start.
fn say(what: impl std::fmt::Display) {
    let ms = T0.get().map_or(0, |t0| t0.elapsed().as_millis());
    println!("[{ms:>5} ms] {what}");
}

/// What an asset's loader does.
#[derive(Clone, Copy, Debug)]
enum Script {
    /// Loads for this long, then stops.
    Load(u64),
    /// Panics in its handler after this long.
    Panic(u64),
    /// Sits in one long handler (it never looks at cancellation).
    Stuck,
}

/// Part of each loader's state: says when the state is dropped.
struct Announce(String);

impl Drop for Announce {
    fn drop(&mut self) {
        say(format_args!("  {}: actor state dropped", self.0));
    }
}

/// The job actor: one per asset.
struct AssetLoader;

struct AssetState {
    ctx: WorkerContext,
    script: Script,
    _announce: Announce,
}

impl Actor for AssetLoader {
    type Msg = ();
    type State = AssetState;
    type Arguments = (WorkerContext, Script);

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        (ctx, script): (WorkerContext, Script),
    ) -> Result<AssetState, ActorProcessingErr> {
        say(format_args!(
            "{}: loading on slot {} ({script:?})",
            ctx.job_id(),
            ctx.slot_id()
        ));
        myself.cast(())?;
        let name = ctx.job_id().to_owned();
        Ok(AssetState {
            ctx,
            script,
            _announce: Announce(name),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<()>,
        (): (),
        state: &mut AssetState,
    ) -> Result<(), ActorProcessingErr> {
        match state.script {
            Script::Load(ms) => {
                // Decoded bytes go to the job's own temp dir, removed after the actor is gone.
                tokio::time::sleep(Duration::from_millis(ms)).await;
                std::fs::write(state.ctx.temp_dir().join("decoded.bin"), [0u8; 64])?;
                myself.stop(Some("loaded".into()));
            }
            Script::Panic(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                panic!("corrupt header in {}", state.ctx.job_id());
            }
            Script::Stuck => tokio::time::sleep(Duration::from_secs(3600)).await,
        }
        Ok(())
    }
}

/// What the scene loader hears.
enum SceneMsg {
    Load(Vec<(&'static str, Script)>),
    Done(String, Result<String, String>),
}

/// The engine's scene loader: it spawns a job actor per asset and collects the outcomes.
struct SceneLoader {
    sup: Supervisor,
    done: tokio::sync::mpsc::UnboundedSender<()>,
}

impl Actor for SceneLoader {
    type Msg = SceneMsg;
    type State = usize;
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<SceneMsg>, (): ()) -> Result<usize, ActorProcessingErr> {
        Ok(0)
    }

    async fn handle(
        &self,
        myself: ActorRef<SceneMsg>,
        msg: SceneMsg,
        pending: &mut usize,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SceneMsg::Load(assets) => {
                for (name, script) in assets {
                    *pending += 1;
                    let (sup, me) = (self.sup.clone(), myself.clone());
                    // The wait for a slot happens off this actor's mailbox.
                    tokio::spawn(async move {
                        let job = JobSpec::new(name).expect("valid id");
                        let outcome = match sup
                            .spawn_job(job, AssetLoader, move |ctx| (ctx, script))
                            .await
                        {
                            Ok((_loader, outcome)) => outcome.join().await,
                            Err(err) => Err(err),
                        };
                        // `join` returns only after the release pipeline: the slot is back.
                        let outcome = outcome
                            .map(|exit| exit.reason().unwrap_or("stopped").to_owned())
                            .map_err(|err| {
                                let body = err.body_error();
                                let detail = match (
                                    body.and_then(|b| b.panics().first()),
                                    body.and_then(|b| b.error()),
                                ) {
                                    (Some(panic), _) => format!("panicked: {panic}"),
                                    (None, Some(error)) => error.to_string(),
                                    (None, None) => err.to_string(),
                                };
                                format!("{}, {detail}", err.code())
                            });
                        let _ = me.cast(SceneMsg::Done(name.to_owned(), outcome));
                    });
                }
            }
            SceneMsg::Done(name, outcome) => {
                match outcome {
                    Ok(reason) => say(format_args!("  {name}: slot came back ({reason})")),
                    Err(code) => say(format_args!("  {name}: slot came back ({code})")),
                }
                *pending -= 1;
                if *pending == 0 {
                    let _ = self.done.send(());
                }
            }
        }
        Ok(())
    }
}

/// Asks the lease desk for a slot by message; the lease goes back when it stops.
struct ShaderWarmer {
    desk: ActorRef<LeaseMsg>,
}

impl Actor for ShaderWarmer {
    type Msg = ();
    type State = (Announce, ActorLease);
    type Arguments = ();

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        (): (),
    ) -> Result<Self::State, ActorProcessingErr> {
        let lease = call!(self.desk, LeaseMsg::Acquire, myself.get_cell())??;
        say(format_args!(
            "shader-warmer: holds slot {} by message",
            lease.slot_id()
        ));
        Ok((Announce("shader-warmer".into()), lease))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    T0.get_or_init(Instant::now);
    let sup = Supervisor::builder()
        .slots(2)
        .cancel_grace(Duration::from_millis(300))
        .start()
        .await?;

    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let loader = SceneLoader {
        sup: sup.clone(),
        done: done_tx,
    };
    let (scene, scene_join) = Actor::spawn(Some("scene-loader".into()), loader, ()).await?;
    scene.cast(SceneMsg::Load(vec![
        ("rock.mesh", Script::Load(120)),
        ("hero.tex", Script::Panic(80)),
        ("terrain.mesh", Script::Stuck),
        ("sky.tex", Script::Load(60)),
        ("tree.mesh", Script::Load(90)),
        ("water.mat", Script::Load(40)),
    ]))?;

    // Cancel the stuck loader once it is running: the stop waits behind its handler, so it
    // is killed a cancel grace later.
    loop {
        let running = sup
            .leases()
            .iter()
            .any(|l| l.job_id.as_deref() == Some("terrain.mesh"));
        if running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    say("cancelling terrain.mesh mid-work");
    sup.cancel("terrain.mesh").await?;

    done_rx.recv().await;
    scene.stop(None);
    scene_join.await?;

    let desk = sup.lease_desk().await?;
    let (warmer, warmer_join) = Actor::spawn(None, ShaderWarmer { desk }, ()).await?;
    say(format_args!(
        "shader-warmer running; slots held: {}",
        sup.stats().active
    ));
    warmer.stop(None);
    warmer_join.await?;
    while sup.stats().active != 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    say("  shader-warmer: slot came back after its exit");

    let report = sup.shutdown().await?;
    let stats = report.stats;
    say(format_args!(
        "shutdown: {} leases granted, {} released, {} quarantined",
        stats.acquired_total, stats.released_total, stats.quarantined
    ));
    Ok(())
}
