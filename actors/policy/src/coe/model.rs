//! The Collaboration-of-Experts application model.
//!
//! A CoE application is a forest of experts: a request enters at a *preliminary* (root) expert,
//! whose output selects which of its child (*subsequent*) experts run next, and so on down the
//! tree (depth 2 or more). Each expert has a size in bytes, a pre-assessed selection probability
//! and a tier its weights live on when no executor holds it. The policy never sees expert
//! outputs, only the selection events the shell derives from them.

use std::fmt;

/// Most experts a model may have (a cap for untrusted model descriptions).
pub const MAX_EXPERTS: usize = 100_000;
/// Deepest dependency chain allowed (root = depth 1).
pub const MAX_DEPTH: u32 = 16;
/// Largest expert size accepted, in bytes (1 TiB).
pub const MAX_EXPERT_BYTES: u64 = 1 << 40;

/// Identifies an expert: its index in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExpertId(pub u32);

impl ExpertId {
    /// The expert's index in [`CoeModel::experts`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ExpertId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

/// Identifies a request (chosen by the caller; unique among requests in flight).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// Where an expert's weights live when no executor holds them (the tier a load reads from).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Host (CPU) memory.
    Host,
    /// Local SSD.
    Ssd,
}

impl Tier {
    /// Both tiers, in a fixed order.
    pub const ALL: [Tier; 2] = [Tier::Host, Tier::Ssd];

    /// The name used in text formats.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Ssd => "ssd",
        }
    }

    /// Parse a tier name as written by [`Tier::name`].
    pub fn from_name(name: &str) -> Option<Tier> {
        match name {
            "host" => Some(Tier::Host),
            "ssd" => Some(Tier::Ssd),
            _ => None,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an expert is in the dependency graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertKind {
    /// An entry point: requests start here.
    Preliminary,
    /// Runs only after `preliminary` has run on the same request and selected it.
    Subsequent {
        /// The expert whose output selects this one.
        preliminary: ExpertId,
    },
}

/// How a caller describes one expert when building a model; ids are positions in the list.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertSpec {
    /// Weights size in bytes (what a load moves and what residency costs).
    pub size_bytes: u64,
    /// For a preliminary: the share of requests entering here. For a subsequent: the probability
    /// that its preliminary selects it, given the preliminary ran.
    pub select_prob: f64,
    /// Tier the weights are read from on a load.
    pub home: Tier,
    /// The preliminary expert this one depends on (`None` for an entry point). Must be declared
    /// earlier in the list.
    pub parent: Option<ExpertId>,
}

/// One expert of a validated model.
#[derive(Clone, Debug, PartialEq)]
pub struct Expert {
    /// This expert's id.
    pub id: ExpertId,
    /// Weights size in bytes.
    pub size_bytes: u64,
    /// Probability of being selected given its parent ran (entry share for a preliminary).
    pub select_prob: f64,
    /// Pre-assessed usage probability: the chance a request uses this expert (product of the
    /// selection probabilities along its path).
    pub usage_prob: f64,
    /// Tier the weights are read from on a load.
    pub home: Tier,
    /// Preliminary or subsequent (with the expert it depends on).
    pub kind: ExpertKind,
    /// Experts this one's output may select.
    pub children: Vec<ExpertId>,
    /// 1 for an entry point, parent's depth + 1 otherwise.
    pub depth: u32,
}

impl Expert {
    /// The expert this one depends on, if any.
    pub fn preliminary(&self) -> Option<ExpertId> {
        match self.kind {
            ExpertKind::Preliminary => None,
            ExpertKind::Subsequent { preliminary } => Some(preliminary),
        }
    }

    /// Whether a request that ran this expert must wait for a selection event.
    pub fn has_children(&self) -> bool {
        !self.children.is_empty()
    }
}

/// Why a model description was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// No experts at all.
    #[error("the model has no experts")]
    Empty,
    /// More experts than [`MAX_EXPERTS`].
    #[error("{0} experts is more than the cap of {MAX_EXPERTS}")]
    TooManyExperts(usize),
    /// Size zero or above [`MAX_EXPERT_BYTES`].
    #[error("expert e{index}: size {size} bytes is outside 1..={MAX_EXPERT_BYTES}")]
    BadSize {
        /// Index of the expert.
        index: usize,
        /// The size given.
        size: u64,
    },
    /// Probability not a finite number in `0..=1`.
    #[error("expert e{index}: probability {prob} is not within 0..=1")]
    BadProbability {
        /// Index of the expert.
        index: usize,
        /// The probability given.
        prob: f64,
    },
    /// Parent missing or declared later (which also rules out cycles).
    #[error("expert e{index}: parent e{parent} must be an expert declared before it")]
    BadParent {
        /// Index of the expert.
        index: usize,
        /// The parent id given.
        parent: u32,
    },
    /// Dependency chain deeper than [`MAX_DEPTH`].
    #[error("expert e{index}: dependency chain deeper than {MAX_DEPTH}")]
    TooDeep {
        /// Index of the expert.
        index: usize,
    },
}

/// A validated CoE application: experts indexed by id, with children lists and usage
/// probabilities derived from the selection probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct CoeModel {
    experts: Vec<Expert>,
}

impl CoeModel {
    /// Validate `specs` (sizes, probabilities, parents declared earlier, depth cap) and build the
    /// model; expert `i` gets id `ExpertId(i)`.
    pub fn new(specs: Vec<ExpertSpec>) -> Result<CoeModel, ModelError> {
        if specs.is_empty() {
            return Err(ModelError::Empty);
        }
        if specs.len() > MAX_EXPERTS {
            return Err(ModelError::TooManyExperts(specs.len()));
        }
        let mut experts: Vec<Expert> = Vec::with_capacity(specs.len());
        for (index, spec) in specs.into_iter().enumerate() {
            if spec.size_bytes == 0 || spec.size_bytes > MAX_EXPERT_BYTES {
                return Err(ModelError::BadSize { index, size: spec.size_bytes });
            }
            if !(0.0..=1.0).contains(&spec.select_prob) {
                return Err(ModelError::BadProbability { index, prob: spec.select_prob });
            }
            let (kind, usage_prob, depth) = match spec.parent {
                None => (ExpertKind::Preliminary, spec.select_prob, 1),
                Some(parent) => {
                    let p = experts
                        .get(parent.index())
                        .ok_or(ModelError::BadParent { index, parent: parent.0 })?;
                    if p.depth >= MAX_DEPTH {
                        return Err(ModelError::TooDeep { index });
                    }
                    (
                        ExpertKind::Subsequent { preliminary: parent },
                        p.usage_prob * spec.select_prob,
                        p.depth + 1,
                    )
                }
            };
            let id = ExpertId(index as u32);
            if let Some(parent) = spec.parent {
                experts[parent.index()].children.push(id);
            }
            experts.push(Expert {
                id,
                size_bytes: spec.size_bytes,
                select_prob: spec.select_prob,
                usage_prob,
                home: spec.home,
                kind,
                children: Vec::new(),
                depth,
            });
        }
        Ok(CoeModel { experts })
    }

    /// All experts, indexed by id.
    pub fn experts(&self) -> &[Expert] {
        &self.experts
    }

    /// The expert with this id, if it exists.
    pub fn expert(&self, id: ExpertId) -> Option<&Expert> {
        self.experts.get(id.index())
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        self.experts.len()
    }

    /// Always false: a model has at least one expert.
    pub fn is_empty(&self) -> bool {
        self.experts.is_empty()
    }

    /// Size of an expert in bytes (0 for an unknown id).
    pub fn size_of(&self, id: ExpertId) -> u64 {
        self.expert(id).map_or(0, |e| e.size_bytes)
    }

    /// Entry-point experts.
    pub fn roots(&self) -> impl Iterator<Item = &Expert> {
        self.experts.iter().filter(|e| e.kind == ExpertKind::Preliminary)
    }

    /// Sum of all expert sizes.
    pub fn total_bytes(&self) -> u64 {
        self.experts.iter().map(|e| e.size_bytes).sum()
    }

    /// Longest dependency chain (1 when every expert is an entry point).
    pub fn depth(&self) -> u32 {
        self.experts.iter().map(|e| e.depth).max().unwrap_or(0)
    }

    /// Whether `child` depends directly on `parent`.
    pub fn is_child_of(&self, child: ExpertId, parent: ExpertId) -> bool {
        self.expert(child).and_then(Expert::preliminary) == Some(parent)
    }

    /// The specs this model was built from (round-trips through [`CoeModel::new`]).
    pub fn specs(&self) -> Vec<ExpertSpec> {
        self.experts
            .iter()
            .map(|e| ExpertSpec {
                size_bytes: e.size_bytes,
                select_prob: e.select_prob,
                home: e.home,
                parent: e.preliminary(),
            })
            .collect()
    }
}

/// A request as the scheduler sees it on arrival: who it is and which entry expert it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Caller-chosen id.
    pub id: RequestId,
    /// The preliminary expert the request enters at.
    pub root: ExpertId,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(size: u64, p: f64, parent: Option<u32>) -> ExpertSpec {
        ExpertSpec { size_bytes: size, select_prob: p, home: Tier::Ssd, parent: parent.map(ExpertId) }
    }

    #[test]
    fn builds_graph_and_usage_probabilities() {
        let m = CoeModel::new(vec![
            spec(10, 0.5, None),
            spec(20, 0.5, None),
            spec(5, 0.4, Some(0)),
            spec(5, 0.5, Some(2)),
        ])
        .unwrap();
        assert_eq!(m.depth(), 3);
        assert_eq!(m.expert(ExpertId(0)).unwrap().children, vec![ExpertId(2)]);
        assert!(m.is_child_of(ExpertId(3), ExpertId(2)));
        assert!(!m.is_child_of(ExpertId(3), ExpertId(0)));
        // 0.5 * 0.4 * 0.5
        assert!((m.expert(ExpertId(3)).unwrap().usage_prob - 0.1).abs() < 1e-12);
        assert_eq!(m.total_bytes(), 40);
        assert_eq!(CoeModel::new(m.specs()).unwrap(), m);
    }

    #[test]
    fn rejects_bad_specs() {
        assert_eq!(CoeModel::new(vec![]), Err(ModelError::Empty));
        assert!(matches!(CoeModel::new(vec![spec(0, 0.5, None)]), Err(ModelError::BadSize { index: 0, .. })));
        assert!(matches!(
            CoeModel::new(vec![spec(1, 1.5, None)]),
            Err(ModelError::BadProbability { index: 0, .. })
        ));
        assert!(matches!(
            CoeModel::new(vec![spec(1, f64::NAN, None)]),
            Err(ModelError::BadProbability { .. })
        ));
        // A parent declared later (or itself) is refused, which rules out cycles.
        assert!(matches!(
            CoeModel::new(vec![spec(1, 0.5, Some(0))]),
            Err(ModelError::BadParent { index: 0, parent: 0 })
        ));
    }
}
