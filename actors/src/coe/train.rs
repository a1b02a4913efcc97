//! What a generated CoE app's experts are trained on: a seeded train / calibration / test split
//! of the digits, the digit classes each expert covers (a preliminary splits its classes into
//! one coarse group per subsequent expert), and each expert's training rows and targets.
//!
//! Pure and deterministic from the seed; [`super::app`] runs the training and the experts.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use troupe_policy::coe::{CoeModel, ExpertId};

/// Outputs of a leaf expert: the ten digit classes.
pub const DIGIT_CLASSES: usize = 10;
/// Share of the images that train the experts (the rest is split evenly into calibration and test).
pub const TRAIN_SHARE: f64 = 0.6;
/// A leaf also trains on out-of-group images, this many per in-group image, so that a routing
/// mistake upstream still meets an expert that has seen such digits (ci, seeds 3/1/5: 0.5 gave
/// CoE accuracy 0.947/0.963/0.947, 2 gave 0.959/0.962/0.963, all train images 0.958/0.961/0.970
/// at three times the training).
pub const OTHERS_PER_OWN: f64 = 2.0;
/// Salt of the split's random stream (kept apart from the generator's own stream).
const SPLIT_SALT: u64 = 0x5eed_5b11_7000_0001;

/// Disjoint image indices: the experts train on `train`, usage probabilities come from
/// `calibration`, accuracies and the trace's images from `test`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    /// Training images.
    pub train: Vec<usize>,
    /// Calibration images (usage probabilities).
    pub calibration: Vec<usize>,
    /// Held-out images (accuracies, the trace's requests).
    pub test: Vec<usize>,
}

/// Shuffle `0..n` with `seed` and cut it into [`TRAIN_SHARE`] train, then calibration and test halves.
pub fn split(n: usize, seed: u64) -> Split {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut SmallRng::seed_from_u64(seed ^ SPLIT_SALT));
    let train_n = ((n as f64) * TRAIN_SHARE).round() as usize;
    let calib_n = (n - train_n.min(n)) / 2;
    let test = order.split_off((train_n + calib_n).min(n));
    let calibration = order.split_off(train_n.min(n));
    Split { train: order, calibration, test }
}

/// The classes each expert covers, in id order: a root covers all ten (in an order shuffled
/// per root, so the entry experts group them differently); a preliminary deals its classes to
/// its subsequent experts in contiguous runs (sizes differing by at most one). With more
/// subsequent experts than classes, they share classes round-robin.
pub fn class_groups(model: &CoeModel, rng: &mut SmallRng) -> Vec<Vec<u8>> {
    let mut groups: Vec<Vec<u8>> = vec![Vec::new(); model.len()];
    for e in model.experts() {
        if e.preliminary().is_none() {
            let mut all: Vec<u8> = (0..DIGIT_CLASSES as u8).collect();
            all.shuffle(rng);
            groups[e.id.index()] = all;
        }
        let own = groups[e.id.index()].clone();
        let k = e.children.len();
        for (j, c) in e.children.iter().enumerate() {
            groups[c.index()] = if own.len() >= k {
                let (lo, hi) = (j * own.len() / k, (j + 1) * own.len() / k);
                own[lo..hi].to_vec()
            } else if own.is_empty() {
                Vec::new()
            } else {
                vec![own[j % own.len()]]
            };
        }
    }
    groups
}

/// Which subsequent expert (index into `children`) should take an image of `label`: the one
/// covering it; when several share it, the image's index picks among them.
pub fn route_target(groups: &[Vec<u8>], children: &[ExpertId], label: u8, image: usize) -> Option<usize> {
    let holders: Vec<usize> = children
        .iter()
        .enumerate()
        .filter(|(_, c)| groups.get(c.index()).is_some_and(|g| g.contains(&label)))
        .map(|(j, _)| j)
        .collect();
    (!holders.is_empty()).then(|| holders[image % holders.len()])
}

/// Training rows of a preliminary: the train images of its classes, each with the index of the
/// subsequent expert covering its label. At most `max_rows`.
pub fn preliminary_rows(
    groups: &[Vec<u8>],
    expert: ExpertId,
    children: &[ExpertId],
    train: &[usize],
    labels: &[u8],
    max_rows: usize,
) -> (Vec<usize>, Vec<usize>) {
    let own = &groups[expert.index()];
    train
        .iter()
        .filter(|&&i| own.contains(&labels[i]))
        .filter_map(|&i| Some((i, route_target(groups, children, labels[i], i)?)))
        .take(max_rows)
        .unzip()
}

/// Training rows of a leaf: every train image of its classes plus [`OTHERS_PER_OWN`] as many
/// others (drawn with `rng`), each with its digit label. At most `max_rows`.
pub fn leaf_rows(
    groups: &[Vec<u8>],
    expert: ExpertId,
    train: &[usize],
    labels: &[u8],
    max_rows: usize,
    rng: &mut SmallRng,
) -> (Vec<usize>, Vec<usize>) {
    let own = &groups[expert.index()];
    let (mut rows, mut others): (Vec<usize>, Vec<usize>) =
        train.iter().partition(|&&i| own.contains(&labels[i]));
    others.shuffle(rng);
    let extra = ((rows.len() as f64) * OTHERS_PER_OWN).round() as usize;
    rows.extend(others.into_iter().take(extra));
    rows.shuffle(rng);
    rows.truncate(max_rows);
    let targets = rows.iter().map(|&i| usize::from(labels[i])).collect();
    (rows, targets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_policy::coe::ExpertSpec;
    use troupe_policy::coe::Tier;

    fn spec(parent: Option<u32>) -> ExpertSpec {
        ExpertSpec { size_bytes: 1, select_prob: 1.0, home: Tier::Ssd, parent: parent.map(ExpertId) }
    }

    #[test]
    fn split_is_disjoint_complete_and_seeded() {
        let s = split(1797, 3);
        assert_eq!((s.train.len(), s.calibration.len(), s.test.len()), (1078, 359, 360));
        let mut all: Vec<usize> = s.train.iter().chain(&s.calibration).chain(&s.test).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..1797).collect::<Vec<_>>());
        assert_eq!(split(1797, 3), s);
        assert_ne!(split(1797, 4), s);
    }

    #[test]
    fn groups_partition_a_preliminary_classes() {
        // Root 0 with three children; child 1 has two children of its own.
        let model = CoeModel::new(vec![
            spec(None),
            spec(Some(0)),
            spec(Some(0)),
            spec(Some(0)),
            spec(Some(1)),
            spec(Some(1)),
        ])
        .unwrap();
        let g = class_groups(&model, &mut SmallRng::seed_from_u64(1));
        assert_eq!(g[0].len(), 10);
        let mut union: Vec<u8> = [&g[1], &g[2], &g[3]].iter().flat_map(|v| v.iter().copied()).collect();
        union.sort_unstable();
        assert_eq!(union, (0..10).collect::<Vec<u8>>());
        assert_eq!((g[1].len(), g[2].len(), g[3].len()), (3, 3, 4));
        assert_eq!(g[4].len() + g[5].len(), 3);
        let kids = [ExpertId(1), ExpertId(2), ExpertId(3)];
        assert_eq!(route_target(&g, &kids, g[2][0], 0), Some(1));
        // One class, two children: they share it and the image index alternates.
        let tiny = vec![vec![7], vec![7], vec![7]];
        let two = [ExpertId(1), ExpertId(2)];
        assert_eq!((route_target(&tiny, &two, 7, 0), route_target(&tiny, &two, 7, 1)), (Some(0), Some(1)));
        assert_eq!(route_target(&tiny, &two, 3, 0), None);
    }

    #[test]
    fn leaf_rows_hold_the_group_and_some_others() {
        let groups = vec![(0..10).collect(), vec![1, 2]];
        let labels: Vec<u8> = (0..100).map(|i| (i % 10) as u8).collect();
        let train: Vec<usize> = (0..100).collect();
        let (rows, targets) =
            leaf_rows(&groups, ExpertId(1), &train, &labels, 1000, &mut SmallRng::seed_from_u64(2));
        let own = rows.iter().filter(|&&i| labels[i] == 1 || labels[i] == 2).count();
        assert_eq!((own, rows.len()), (20, 60));
        assert!(rows.iter().zip(&targets).all(|(&i, &t)| usize::from(labels[i]) == t));
    }
}
