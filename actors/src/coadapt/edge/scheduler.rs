//! The edge's scheduler half: what one incarnation adapts on (the real engine with the teacher,
//! or the stand-in), and the [`Scheduler`] that admits the accepted uploads into it, runs its
//! cycles on a blocking thread and answers each adapted phase through the shared store.

use super::*;

/// What adapts in one scheduler incarnation: the real engine with the teacher, or the stand-in.
enum Adapter {
    Real { engine: Box<EdgeEngine>, teacher: Arc<VMoe>, train: Arc<Dataset> },
    Sim(Box<SimEdge>),
}

/// A task that left the adapter, either kind.
struct Adapted {
    task: TaskId,
    name: String,
    params: Vec<f32>,
    before: f64,
    after: f64,
    epochs: u32,
    reached: bool,
    arrived: Micros,
    done: Micros,
}

impl From<Finished> for Adapted {
    fn from(f: Finished) -> Self {
        Self {
            task: f.task,
            name: f.name,
            params: trainable_params(&f.model),
            before: f.before,
            after: f.after,
            epochs: f.epochs,
            reached: f.reached,
            arrived: f.arrived,
            done: f.done,
        }
    }
}

impl From<SimFinished> for Adapted {
    fn from(f: SimFinished) -> Self {
        let SimFinished { task, name, params, before, after, epochs, reached, arrived, done } = f;
        Self { task, name, params, before, after, epochs, reached, arrived, done }
    }
}

/// What one cycle of the adapter did.
struct CycleOut {
    done: Vec<Adapted>,
    busy: bool,
    peak_used: u64,
    result: Result<(), String>,
}

impl Adapter {
    /// Admits `request` at `now` (the real engine on a blocking thread, the stand-in spending
    /// its modelled time on tokio's clock).
    async fn admit(
        self,
        request: UploadRequest,
        now: Micros,
    ) -> Result<(Self, Result<(TaskId, Vec<u32>), String>), tokio::task::JoinError> {
        match self {
            Adapter::Real { mut engine, teacher, train } => {
                tokio::task::spawn_blocking(move || {
                    let r = admit(&mut engine, &teacher, &train, &request, now);
                    (Adapter::Real { engine, teacher, train }, r)
                })
                .await
            }
            Adapter::Sim(mut edge) => {
                let r = edge.admit(now, &request);
                if let Ok((_, _, cost)) = &r {
                    tokio::time::sleep(*cost).await;
                }
                Ok((Adapter::Sim(edge), r.map(|(task, labels, _)| (task, labels))))
            }
        }
    }

    /// Runs one cycle.
    async fn cycle(self, clock: Clock) -> Result<(Self, CycleOut), tokio::task::JoinError> {
        match self {
            Adapter::Real { mut engine, teacher, train } => {
                tokio::task::spawn_blocking(move || {
                    let result = engine.run_cycle(&|| clock.now()).map_err(|e| e.to_string());
                    let done = engine.take_finished().into_iter().map(Adapted::from).collect();
                    let out =
                        CycleOut { done, busy: engine.busy(), peak_used: engine.pool().peak_used(), result };
                    let pool = engine.pool().stats();
                    crate::live::set_pool(
                        "coadapt/edge",
                        pool.budget,
                        pool.used,
                        pool.external_fragmentation,
                    );
                    (Adapter::Real { engine, teacher, train }, out)
                })
                .await
            }
            Adapter::Sim(mut edge) => {
                let cost = edge.run_cycle(clock.now());
                tokio::time::sleep(cost).await;
                let done = edge.take_finished().into_iter().map(Adapted::from).collect();
                let out = CycleOut { done, busy: edge.busy(), peak_used: 0, result: Ok(()) };
                Ok((Adapter::Sim(edge), out))
            }
        }
    }

    fn scheduler_name(&self) -> &'static str {
        match self {
            Adapter::Real { engine, .. } => engine.scheduler_name(),
            Adapter::Sim(edge) => edge.scheduler_name(),
        }
    }
}

/// The edge's decision state for one incarnation (rebuilt by `recover`).
struct Live {
    adapter: Option<Adapter>,
    clock: Clock,
    /// Engine task -> (store key, teacher labels of its evaluation frames).
    tasks: BTreeMap<TaskId, (u64, Vec<u32>)>,
    admitted: BTreeSet<u64>,
    cycling: bool,
}

/// The edge workload half of the scheduler shell.
pub struct EdgeScheduler {
    shared: Arc<EdgeShared>,
    live: Option<Live>,
}

impl EdgeScheduler {
    /// A scheduler over the shared edge state (its engine is built in `recover`).
    pub fn new(shared: Arc<EdgeShared>) -> Self {
        Self { shared, live: None }
    }
}

fn labelled(teacher: &VMoe, pixels: &[f32]) -> Result<Dataset, String> {
    let n = pixels.len() / crate::coadapt::wire::PIXELS;
    let mut d = Dataset { images: pixels.to_vec(), labels: vec![0; n] };
    d.labels = predict_all(teacher, &d).map_err(|e| e.to_string())?;
    Ok(d)
}

/// Labels an upload with the teacher, rebuilds the camera's model (the cached student of its size
/// with the camera's trainable parameters) and submits the job. Returns the task and the teacher's
/// labels of the evaluation frames.
fn admit(
    engine: &mut EdgeEngine,
    teacher: &VMoe,
    train: &Dataset,
    req: &UploadRequest,
    now: Micros,
) -> Result<(TaskId, Vec<u32>), String> {
    let mut model = zoo_student(&req.model, train).map_err(|e| e.to_string())?;
    install_trainable(&mut model, &req.params).map_err(|e| format!("camera parameters: {e}"))?;
    let samples = labelled(teacher, &req.train_images)?;
    let eval = labelled(teacher, &req.eval_images)?;
    let task = engine
        .submit(
            now,
            AdaptJob {
                name: req.camera.clone(),
                model,
                samples,
                target_gain: (req.target_gain > 0.0).then_some(req.target_gain),
                slo_within: None,
            },
        )
        .map_err(|e| e.to_string())?;
    tracing::debug!(camera = %req.camera, task = task.0, uploads = req.train_images.len() / 64, "adaptation task admitted");
    Ok((task, eval.labels.iter().map(|&l| l as u32).collect()))
}

impl Live {
    fn summary(&self, st: &Store) -> EdgeSummary {
        let (budget, peak, frag): (u64, u64, &[FragSample]) = match &self.adapter {
            Some(Adapter::Real { engine: e, .. }) => {
                (e.pool().stats().budget, e.pool().peak_used(), e.pool().fragmentation_samples())
            }
            Some(Adapter::Sim(_)) | None => (0, 0, &[]),
        };
        let max_fragmentation = frag.iter().map(|s| s.external_fragmentation).fold(0.0, f64::max);
        // Over time (each state for as long as it lasted), the per-event mean when no time passed.
        let mean_fragmentation = time_weighted_fragmentation(frag, monotonic_us()).unwrap_or_else(|| {
            frag.iter().map(|s| s.external_fragmentation).sum::<f64>() / frag.len().max(1) as f64
        });
        let every = (frag.len() / 12).max(1);
        let timeline =
            frag.iter().step_by(every).map(|s| (s.event, s.used, s.external_fragmentation)).collect();
        EdgeSummary {
            cameras: st.cameras.clone(),
            budget,
            peak_used: peak.max(st.peak_used),
            events: frag.len() as u64,
            max_fragmentation,
            mean_fragmentation,
            timeline,
            tasks_done: st.done,
            scheduler: self.adapter.as_ref().map_or("", Adapter::scheduler_name).to_string(),
        }
    }

    fn answer_waiters(&self, shared: &EdgeShared) {
        let mut st = lock(&shared.store);
        let progress = progress_of(&st.cameras);
        let done = |n: u32| completion(n, &progress).done;
        if !st.waiters.iter().any(|(n, _)| done(*n)) {
            return;
        }
        let bytes = encode(&self.summary(&st));
        let (ready, wait): (Vec<_>, Vec<_>) = st.waiters.drain(..).partition(|(n, _)| done(*n));
        st.waiters = wait;
        for (_, port) in ready {
            let _ = port.send(bytes.clone());
        }
    }

    /// Admits every accepted upload this incarnation has not admitted yet.
    async fn admit_accepted(&mut self, shared: &EdgeShared, me: &EdgeRef) -> Result<(), ActorProcessingErr> {
        let fresh: Vec<(u64, UploadRequest)> = {
            let st = lock(&shared.store);
            st.accepted
                .iter()
                .filter(|(k, _)| !self.admitted.contains(k))
                .map(|(k, a)| (*k, a.request.clone()))
                .collect()
        };
        for (key, request) in fresh {
            self.admitted.insert(key);
            let Some(adapter) = self.adapter.take() else { return Ok(()) };
            let (adapter, admitted) = adapter.admit(request, self.clock.now()).await?;
            self.adapter = Some(adapter);
            match admitted {
                Ok((task, labels)) => {
                    self.tasks.insert(task, (key, labels));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "refusing an upload");
                    shared.answer(key, refused(e), false);
                }
            }
        }
        if !self.cycling && !self.tasks.is_empty() {
            self.cycling = true;
            SchedulerMsg::tell(me, EdgeInput::Cycle)?;
        }
        Ok(())
    }

    fn reply_finished(&mut self, shared: &EdgeShared, done: Vec<Adapted>) {
        for f in done {
            let latency_ms = f.done.saturating_sub(f.arrived).0 / 1000;
            tracing::info!(
                task = f.task.0, camera = %f.name, before = f.before, after = f.after, epochs = f.epochs,
                reached = f.reached, latency_ms, "adaptation task complete"
            );
            let Some((key, eval_teacher_labels)) = self.tasks.remove(&f.task) else { continue };
            lock(&shared.store).done += 1;
            crate::work::COADAPT.done();
            let reply = AdaptOutcome::Adapted(AdaptReply {
                task: f.task.0,
                params: f.params,
                eval_teacher_labels,
                val_before: f.before,
                val_after: f.after,
                epochs: f.epochs,
                reached: f.reached,
                latency_ms,
            });
            shared.answer(key, encode(&reply), true);
        }
    }

    async fn cycle(&mut self, shared: &EdgeShared, me: &EdgeRef) -> Result<(), ActorProcessingErr> {
        let Some(adapter) = self.adapter.take() else { return Ok(()) };
        let (adapter, CycleOut { done, busy, peak_used, result }) = adapter.cycle(self.clock).await?;
        {
            let mut st = lock(&shared.store);
            st.peak_used = st.peak_used.max(peak_used);
        }
        self.adapter = Some(adapter);
        self.reply_finished(shared, done);
        if let Err(e) = result {
            // Nothing can make progress (memory refused with nothing to evict): refuse the
            // waiting cameras rather than spin.
            tracing::error!(error = %e, "adaptation cycle failed");
            for (_, (key, _)) in std::mem::take(&mut self.tasks) {
                crate::work::COADAPT.failed();
                shared.answer(key, refused(e.clone()), false);
            }
            self.cycling = false;
            return Ok(());
        }
        self.cycling = busy;
        if busy {
            SchedulerMsg::tell(me, EdgeInput::Cycle)?;
        }
        Ok(())
    }
}

impl Scheduler for EdgeScheduler {
    type Input = EdgeInput;

    async fn recover(&mut self, me: &EdgeRef, _now: Micros) -> Result<(), ActorProcessingErr> {
        let shared = self.shared.clone();
        let cfg = shared.args.engine;
        let expected: Vec<_> =
            shared.args.expected.iter().map(|s| student_config(s)).collect::<Result<Vec<_>, _>>()?;
        let adapter = match shared.args.compute {
            EdgeCompute::Sim(spec) => Adapter::Sim(Box::new(SimEdge::new(spec, cfg, &expected))),
            EdgeCompute::Real => {
                let (engine, teacher, train) = tokio::task::spawn_blocking(move || {
                    let (train, _) = digits()?;
                    let teacher = zoo_teacher(&train)?;
                    let engine = EdgeEngine::new(cfg, &expected).map_err(|e| e.to_string())?;
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>((engine, teacher, train))
                })
                .await??;
                Adapter::Real { engine: Box::new(engine), teacher: Arc::new(teacher), train: Arc::new(train) }
            }
        };
        let mut live = Live {
            adapter: Some(adapter),
            clock: Clock::start(),
            tasks: BTreeMap::new(),
            admitted: BTreeSet::new(),
            cycling: false,
        };
        lock(&shared.store).scheduler = Some(me.clone());
        live.admit_accepted(&shared, me).await?;
        let pending = lock(&shared.store).accepted.len();
        tracing::info!(budget = cfg.budget, scheduler = cfg.scheduler.name(), pending, "coadapt edge ready");
        live.answer_waiters(&shared);
        self.live = Some(live);
        Ok(())
    }

    async fn handle(
        &mut self,
        me: &EdgeRef,
        _now: Micros,
        input: EdgeInput,
    ) -> Result<(), ActorProcessingErr> {
        let shared = self.shared.clone();
        let live = self.live.as_mut().ok_or("edge scheduler used before recover")?;
        match input {
            EdgeInput::Accepted => live.admit_accepted(&shared, me).await,
            EdgeInput::Reported => {
                live.answer_waiters(&shared);
                Ok(())
            }
            EdgeInput::Cycle => live.cycle(&shared, me).await,
        }
    }
}
