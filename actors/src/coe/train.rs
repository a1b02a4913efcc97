//! What a generated CoE app's experts are trained on: a seeded train / calibration / test split
//! of the digits, the digit classes each expert covers (a preliminary splits its classes into
//! one coarse group per subsequent expert), and each expert's training rows and targets.
//!
//! Pure and deterministic from the seed; [`super::app`] runs the training and the experts.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::{SliceRandom, index};
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

/// How much the digit classes overlap, symmetric: `affinity[a][b]` is the share of the
/// [`NEIGHBOURS`] nearest train images (Euclidean, leave-one-out) of a class-`a` image that are of
/// class `b`, averaged over `a`'s images, plus the same from `b`'s side. Classes that are near
/// in input space are the ones a preliminary confuses, so [`class_groups`] keeps them together.
pub type Affinity = [[f64; DIGIT_CLASSES]; DIGIT_CLASSES];

/// `affinity` between classes `a` and `b`; 0 for a label outside the ten classes.
fn pair(affinity: &Affinity, a: u8, b: u8) -> f64 {
    affinity.get(usize::from(a)).and_then(|row| row.get(usize::from(b))).copied().unwrap_or(0.0)
}

/// The affinity kept inside group `g` (each pair counted from both sides).
fn inside(affinity: &Affinity, g: &[u8]) -> f64 {
    g.iter().flat_map(|&a| g.iter().map(move |&b| pair(affinity, a, b))).sum()
}

/// Neighbours per image behind [`class_affinity`].
pub const NEIGHBOURS: usize = 10;

/// The [`Affinity`] of the digit classes over the `train` images (rows of `images`, labels in
/// `labels`); labels outside the ten classes are skipped.
pub fn class_affinity(images: &[Vec<f32>], labels: &[u8], train: &[usize]) -> Affinity {
    let rows: Vec<usize> =
        train.iter().copied().filter(|&i| usize::from(labels[i]) < DIGIT_CLASSES).collect();
    let mut counts = [[0.0f64; DIGIT_CLASSES]; DIGIT_CLASSES];
    let mut per_class = [0usize; DIGIT_CLASSES];
    let mut near: Vec<(f32, u8)> = Vec::with_capacity(rows.len());
    for &i in &rows {
        near.clear();
        near.extend(rows.iter().filter(|&&j| j != i).map(|&j| {
            let d: f32 = images[i].iter().zip(&images[j]).map(|(a, b)| (a - b) * (a - b)).sum();
            (d, labels[j])
        }));
        let k = NEIGHBOURS.min(near.len());
        if k == 0 {
            continue;
        }
        near.select_nth_unstable_by(k - 1, |a, b| a.0.total_cmp(&b.0));
        let a = usize::from(labels[i]);
        per_class[a] += 1;
        for &(_, b) in &near[..k] {
            counts[a][usize::from(b)] += 1.0 / k as f64;
        }
    }
    let share = |x: usize, y: usize| if per_class[x] == 0 { 0.0 } else { counts[x][y] / per_class[x] as f64 };
    std::array::from_fn(|a| std::array::from_fn(|b| if a == b { 0.0 } else { share(a, b) + share(b, a) }))
}

/// Most classes [`partition`] searches exhaustively; past it, contiguous runs.
const MAX_SEARCHED_CLASSES: usize = 12;

/// Cut `classes` into `k` groups of sizes differing by at most one (larger ones last) that keep
/// the most [`Affinity`] inside groups, so what a preliminary must tell apart is what differs
/// most. Exhaustive over the partitions (at most `MAX_SEARCHED_CLASSES` classes; ties go to
/// the first found in `classes`' order); past that, contiguous runs of `classes`.
pub fn partition(classes: &[u8], k: usize, affinity: &Affinity) -> Vec<Vec<u8>> {
    let n = classes.len();
    let sizes: Vec<usize> = (0..k).map(|j| (j + 1) * n / k - j * n / k).collect();
    if k == 0 || n > MAX_SEARCHED_CLASSES {
        return (0..k).map(|j| classes[j * n / k..(j + 1) * n / k].to_vec()).collect();
    }
    let weight = |a: u8, b: u8| pair(affinity, a, b);
    struct Search<'a> {
        classes: &'a [u8],
        sizes: &'a [usize],
        groups: Vec<Vec<u8>>,
        best: Option<(f64, Vec<Vec<u8>>)>,
    }
    fn go(s: &mut Search<'_>, next: usize, inside: f64, weight: &dyn Fn(u8, u8) -> f64) {
        let Some(&c) = s.classes.get(next) else {
            if s.best.as_ref().is_none_or(|(b, _)| inside > *b + 1e-12) {
                s.best = Some((inside, s.groups.clone()));
            }
            return;
        };
        let mut opened = Vec::new();
        for j in 0..s.groups.len() {
            if s.groups[j].len() == s.sizes[j] {
                continue;
            }
            // Empty groups of one size are interchangeable: open only the first of each size.
            if s.groups[j].is_empty() {
                if opened.contains(&s.sizes[j]) {
                    continue;
                }
                opened.push(s.sizes[j]);
            }
            let gain: f64 = s.groups[j].iter().map(|&o| weight(c, o)).sum();
            s.groups[j].push(c);
            go(s, next + 1, inside + gain, weight);
            s.groups[j].pop();
        }
    }
    let mut search = Search { classes, sizes: &sizes, groups: vec![Vec::new(); k], best: None };
    go(&mut search, 0, 0.0, &weight);
    search.best.map_or_else(|| vec![Vec::new(); k], |(_, g)| g)
}

/// The classes each expert covers, in id order: a root covers all ten (in an order shuffled
/// per root, which breaks ties between equally good groupings); a preliminary cuts its classes
/// into one group per subsequent expert with [`partition`] (sizes differing by at most one,
/// the most overlapping classes kept together), and the groups that keep the most overlap go
/// to the largest subsequent experts. With more subsequent experts than classes, they share
/// classes round-robin.
pub fn class_groups(model: &CoeModel, affinity: &Affinity, rng: &mut SmallRng) -> Vec<Vec<u8>> {
    let mut groups: Vec<Vec<u8>> = vec![Vec::new(); model.len()];
    for e in model.experts() {
        if e.preliminary().is_none() {
            let mut all: Vec<u8> = (0..DIGIT_CLASSES as u8).collect();
            all.shuffle(rng);
            groups[e.id.index()] = all;
        }
        let own = groups[e.id.index()].clone();
        let k = e.children.len();
        if own.len() >= k {
            let mut parts = partition(&own, k, affinity);
            // Hardest groups first, then by size; children largest first (ids break ties).
            parts.sort_by(|a, b| {
                inside(affinity, b).total_cmp(&inside(affinity, a)).then(b.len().cmp(&a.len()))
            });
            let mut children = e.children.clone();
            children.sort_by_key(|c| (std::cmp::Reverse(model.expert(*c).map_or(0, |x| x.size_bytes)), c.0));
            for (c, part) in children.iter().zip(parts) {
                groups[c.index()] = part;
            }
        } else {
            for (j, c) in e.children.iter().enumerate() {
                groups[c.index()] = if own.is_empty() { Vec::new() } else { vec![own[j % own.len()]] };
            }
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

/// Least draw weight of an out-of-group class in [`leaf_rows`], so every class is seen.
pub const OTHERS_FLOOR: f64 = 0.05;

/// Training rows of a leaf: every train image of its classes plus [`OTHERS_PER_OWN`] as many
/// others, each with its digit label; at most `max_rows`. Others are drawn with `rng`, weighted
/// by their class's [`Affinity`] to the group (at least [`OTHERS_FLOOR`]): the images a
/// preliminary misroutes here are most often of classes near the group, so the leaf should
/// know those best.
pub fn leaf_rows(
    groups: &[Vec<u8>],
    expert: ExpertId,
    train: &[usize],
    labels: &[u8],
    max_rows: usize,
    affinity: &Affinity,
    rng: &mut SmallRng,
) -> (Vec<usize>, Vec<usize>) {
    let own = &groups[expert.index()];
    let (mut rows, others): (Vec<usize>, Vec<usize>) = train.iter().partition(|&&i| own.contains(&labels[i]));
    let near = |l: u8| -> f64 {
        let w: f64 = own.iter().map(|&o| pair(affinity, l, o)).sum();
        if w.is_finite() { w.max(0.0) + OTHERS_FLOOR } else { OTHERS_FLOOR }
    };
    let extra = ((rows.len() as f64) * OTHERS_PER_OWN).round() as usize;
    // The weights are finite and positive, so the draw cannot fail.
    let drawn =
        index::sample_weighted(rng, others.len(), |j| near(labels[others[j]]), extra.min(others.len()))
            .map_or_else(|_| Vec::new(), index::IndexVec::into_vec);
    rows.extend(drawn.into_iter().map(|j| others[j]));
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

    /// Affinity 1 between classes of the same block, 0 elsewhere.
    fn blocks(blocks: &[&[u8]]) -> Affinity {
        let mut a = [[0.0; DIGIT_CLASSES]; DIGIT_CLASSES];
        for b in blocks {
            for &x in *b {
                for &y in *b {
                    if x != y {
                        a[usize::from(x)][usize::from(y)] = 1.0;
                    }
                }
            }
        }
        a
    }

    #[test]
    fn affinity_finds_the_classes_that_overlap() {
        // Classes 0 and 1 share one cluster of images, 2 sits alone far away.
        let mut images = Vec::new();
        let mut labels = Vec::new();
        for i in 0..30 {
            let (centre, label) = match i % 3 {
                0 => (0.0, 0),
                1 => (0.0, 1),
                _ => (10.0, 2),
            };
            images.push(vec![centre + (i as f32) * 1e-3; 4]);
            labels.push(label);
        }
        let train: Vec<usize> = (0..30).collect();
        let a = class_affinity(&images, &labels, &train);
        assert!(a[0][1] > 0.5 && a[1][0] == a[0][1], "{:?}", a[0]);
        assert_eq!((a[0][2], a[2][0], a[0][0]), (0.0, 0.0, 0.0));
    }

    #[test]
    fn partition_keeps_overlapping_classes_together_in_near_equal_groups() {
        let a = blocks(&[&[0, 5, 9], &[1, 2, 7], &[3, 4, 6, 8]]);
        let classes: Vec<u8> = (0..10).collect();
        let mut parts = partition(&classes, 3, &a);
        parts.iter_mut().for_each(|p| p.sort_unstable());
        parts.sort();
        assert_eq!(parts, vec![vec![0, 5, 9], vec![1, 2, 7], vec![3, 4, 6, 8]]);
        // Past the searched size: contiguous runs.
        let many: Vec<u8> = (0..13).collect();
        assert_eq!(partition(&many, 2, &a), vec![(0..6).collect::<Vec<u8>>(), (6..13).collect()]);
    }

    #[test]
    fn groups_partition_a_preliminary_classes() {
        // Root 0 with three children; child 1 has two children of its own; child 3 is largest.
        let sized = |parent: Option<u32>, size_bytes: u64| ExpertSpec { size_bytes, ..spec(parent) };
        let model = CoeModel::new(vec![
            spec(None),
            sized(Some(0), 1),
            sized(Some(0), 1),
            sized(Some(0), 9),
            spec(Some(1)),
            spec(Some(1)),
        ])
        .unwrap();
        let a = blocks(&[&[0, 5, 9], &[1, 2, 7], &[3, 4, 6, 8]]);
        let g = class_groups(&model, &a, &mut SmallRng::seed_from_u64(1));
        assert_eq!(g[0].len(), 10);
        let mut union: Vec<u8> = [&g[1], &g[2], &g[3]].iter().flat_map(|v| v.iter().copied()).collect();
        union.sort_unstable();
        assert_eq!(union, (0..10).collect::<Vec<u8>>());
        // The group with the most overlap inside goes to the largest child.
        let mut largest = g[3].clone();
        largest.sort_unstable();
        assert_eq!(largest, vec![3, 4, 6, 8]);
        assert_eq!((g[1].len(), g[2].len()), (3, 3));
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
    fn leaf_rows_hold_the_group_and_others_mostly_near_it() {
        let groups = vec![(0..10).collect(), vec![1, 2]];
        let labels: Vec<u8> = (0..1000).map(|i| (i % 10) as u8).collect();
        let train: Vec<usize> = (0..1000).collect();
        // Class 3 overlaps the group {1, 2}; the other classes do not.
        let a = blocks(&[&[1, 2, 3]]);
        let (rows, targets) =
            leaf_rows(&groups, ExpertId(1), &train, &labels, 10_000, &a, &mut SmallRng::seed_from_u64(2));
        let own = rows.iter().filter(|&&i| labels[i] == 1 || labels[i] == 2).count();
        assert_eq!((own, rows.len()), (200, 600));
        assert!(rows.iter().zip(&targets).all(|(&i, &t)| usize::from(labels[i]) == t));
        // Class 3 weighs 2.05 against 0.05 for each far class: most of its 100 images are drawn,
        // and far classes are drawn too.
        let near = rows.iter().filter(|&&i| labels[i] == 3).count();
        let far = rows.len() - own - near;
        assert!(near > 90 && far > 0, "near {near}, far {far}");
    }
}
