//! Preloading: a task's model is prepared for the pool ([`CoAdaptPool::prepare_load`]: copies and
//! hashes) on a background thread while the current cycle computes, and committed between slices and
//! steps; what the eviction policy allows a preload to unload is only models outside the cycle.

use troupe_kernels::vmoe::pool::PreparedLoad;
use troupe_kernels::vmoe::{CoAdaptPool, VMoeError};
use troupe_policy::adapt::TaskId;
use troupe_policy::adapt::evict::{OnRefusal, Refused, on_refusal, preload_fits};

use super::{EdgeEngine, EngineError};

/// What the background preloading did (preload on).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PreloadStats {
    /// Preparations started on a background thread.
    pub started: u64,
    /// Of them, merged into the pool between slices or steps while another task computed.
    pub committed: u64,
    /// Of them, left on the host because the pool had no room outside the running cycle.
    pub refused: u64,
    /// Commit points at which a finished preparation was kept on the host because merging it
    /// would leave too little room for the running cycle's step ([`preload_fits`]).
    pub deferred: u64,
    /// Of them, taken by the task's own cycle before a commit point merged them.
    pub claimed: u64,
    /// Of them, dropped because the task completed first.
    pub dropped: u64,
    /// Times a cycle had to wait for a preparation still running.
    pub waited: u64,
}

/// A model being prepared on a background thread.
pub(super) type Preparing = std::thread::JoinHandle<Result<PreparedLoad, VMoeError>>;

impl EdgeEngine {
    /// Starts preparing a task's model for the pool on a background thread (copies of its
    /// trainable tensors, hashes of its shared ones) while the current cycle computes.
    pub(super) fn start_preload(&mut self, t: TaskId) {
        if self.preparing.contains_key(&t) {
            return;
        }
        let Some(task) = self.tasks.get_mut(&t) else { return };
        if task.resident.is_some() {
            return;
        }
        let Some(model) = task.stash.take() else { return };
        let name = task.name.clone();
        self.preparing.insert(t, std::thread::spawn(move || CoAdaptPool::prepare_load(&name, model)));
        self.preload_stats.started += 1;
    }

    /// Commits every background preparation that has finished (called between slices and steps)
    /// when the running cycle's step still fits after it ([`preload_fits`]; otherwise it stays
    /// prepared and is tried again at the next commit point or claimed by its own cycle): the
    /// policy may unload a model outside `cycle` to make room; otherwise the model waits on the
    /// host until its cycle merges it.
    pub(super) fn commit_ready(&mut self, cycle: &[TaskId]) -> Result<(), EngineError> {
        let ready: Vec<TaskId> =
            self.preparing.iter().filter(|(_, h)| h.is_finished()).map(|(t, _)| *t).collect();
        for t in ready {
            let bytes = self.tasks.get(&t).map_or(0, |l| super::task_footprint(&l.config));
            if !preload_fits(self.pool.stats().free, bytes, self.step_need) {
                self.preload_stats.deferred += 1;
                continue;
            }
            let Some(handle) = self.preparing.remove(&t) else { continue };
            let mut prepared = join_prepared(handle)?;
            let mut keep = cycle.to_vec();
            keep.push(t);
            loop {
                match self.pool.commit_load(prepared) {
                    Ok(id) => {
                        if let Some(task) = self.tasks.get_mut(&t) {
                            task.resident = Some(id);
                            task.last_cycle = self.cycle;
                        }
                        self.preload_stats.committed += 1;
                        break;
                    }
                    Err(refused) => match on_refusal(&self.residents(&keep), &Refused::Preload(t)) {
                        OnRefusal::Evict(v) => {
                            self.unload_task(v)?;
                            prepared = refused.1;
                        }
                        OnRefusal::Split | OnRefusal::Reload(_) | OnRefusal::GiveUp => {
                            if let Some(task) = self.tasks.get_mut(&t) {
                                task.stash = Some(refused.1.into_model());
                            }
                            self.preload_stats.refused += 1;
                            break;
                        }
                    },
                }
            }
        }
        Ok(())
    }
}

impl Drop for EdgeEngine {
    /// Waits for background preparations (they only copy and hash; none outlives the executor).
    fn drop(&mut self) {
        for (_, h) in std::mem::take(&mut self.preparing) {
            let _ = h.join();
        }
    }
}

/// A background preparation's result.
pub(super) fn join_prepared(h: Preparing) -> Result<PreparedLoad, EngineError> {
    h.join().map_err(|_| EngineError::Invalid("a preload thread panicked".into()))?.map_err(EngineError::from)
}
