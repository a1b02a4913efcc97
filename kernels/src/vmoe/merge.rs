//! The parallel expert set of a co-adaptation group (AdaSprite §2.2): models with identical frozen
//! parts (copies of one student) see each expert slot as the members' copies side by side. Expert
//! `e` of block `b` in the set is one FFN whose hidden units are the members' hidden units of their
//! expert `e` concatenated, down-projection scaled by `1/G` and down bias their mean, so its output
//! is exactly the mean of the members' outputs: a merged set of identical copies computes what one
//! copy does. Every member routes to it through the shared router and keeps its own projector;
//! [`write_back`] returns the hidden units a member's step changed to the members whose experts it
//! may update (the rule is `troupe_policy::adapt::transfer::writable`).

use super::VMoeError;
use super::model::VMoe;
use crate::ops::ExpertParams;
use crate::tensor::Tensor;

/// The group's view for member `task`: the shared parts of member 0 (checked equal in shape; the
/// caller groups copies of one student), every expert slot merged, `task`'s projector and head.
pub fn group_view(members: &[&VMoe], task: usize) -> Result<VMoe, VMoeError> {
    let own = members.get(task).ok_or_else(|| VMoeError::Config(format!("no member {task}")))?;
    let first = members[0];
    if members.iter().any(|m| m.config != first.config) {
        return Err(VMoeError::Config("a group's members must share one config".into()));
    }
    let g = members.len();
    let mut config = first.config;
    config.hidden *= g;
    config.validate()?;
    let mut params = first.params.clone();
    for (b, block) in params.blocks.iter_mut().enumerate() {
        for (e, expert) in block.experts.iter_mut().enumerate() {
            let parts: Vec<&ExpertParams> = members.iter().map(|m| &m.params.blocks[b].experts[e]).collect();
            *expert = parallel_expert(&parts)?;
        }
    }
    params.proj_w = own.params.proj_w.clone();
    params.proj_b = own.params.proj_b.clone();
    params.head_w = own.params.head_w.clone();
    params.head_b = own.params.head_b.clone();
    VMoe::from_params(config, params)
}

/// The members' experts (one slot, each `dim x hidden`) as one expert of hidden `G * hidden` whose
/// output is the mean of theirs.
pub fn parallel_expert(parts: &[&ExpertParams]) -> Result<ExpertParams, VMoeError> {
    let first = parts.first().ok_or_else(|| VMoeError::Config("an empty group".into()))?;
    let (d, h) = first.dims()?;
    let g = parts.len();
    let inv = 1.0 / g as f32;
    let (mut w1, mut b1, mut w2, mut b2) =
        (vec![0.0f32; d * g * h], Vec::with_capacity(g * h), Vec::with_capacity(g * h * d), vec![0.0f32; d]);
    for (k, p) in parts.iter().enumerate() {
        if p.dims()? != (d, h) {
            return Err(VMoeError::Config("members' experts differ in shape".into()));
        }
        let pw1 = p.w1.f32_cow();
        for r in 0..d {
            w1[r * g * h + k * h..r * g * h + (k + 1) * h].copy_from_slice(&pw1[r * h..(r + 1) * h]);
        }
        b1.extend_from_slice(&p.b1.f32_cow());
        w2.extend(p.w2.f32_cow().iter().map(|v| v * inv));
        b2.iter_mut().zip(p.b2.f32_cow().iter()).for_each(|(a, v)| *a += v * inv);
    }
    Ok(ExpertParams {
        w1: Tensor::from_f32(&[d, g * h], w1)?,
        b1: Tensor::from_f32(&[g * h], b1)?,
        w2: Tensor::from_f32(&[g * h, d], w2)?,
        b2: Tensor::from_f32(&[d], b2)?,
    })
}

/// Copies member `k`'s hidden units of every merged expert in `view` back into `members[k]` for
/// each `k` with `writable[k]`, and `view`'s projector and head into `members[task]`. The merged
/// down bias is not written (it is the members' mean, rebuilt by the next [`group_view`]).
pub fn write_back(
    view: &VMoe,
    members: &mut [VMoe],
    task: usize,
    writable: &[bool],
) -> Result<(), VMoeError> {
    let g = members.len();
    if writable.len() != g || task >= g {
        return Err(VMoeError::Config(format!("{} flags for {g} members, task {task}", writable.len())));
    }
    let h = members[0].config.hidden;
    if view.config.hidden != g * h {
        return Err(VMoeError::Config("the view is not this group's".into()));
    }
    let d = view.config.dim;
    for (b, block) in view.params.blocks.iter().enumerate() {
        for (e, merged) in block.experts.iter().enumerate() {
            let (w1, b1, w2) = (merged.w1.f32_cow(), merged.b1.f32_cow(), merged.w2.f32_cow());
            for (k, m) in members.iter_mut().enumerate().filter(|(k, _)| writable[*k]) {
                let x = &mut m.params.blocks[b].experts[e];
                let xw1 = x.w1.f32_mut()?;
                for r in 0..d {
                    xw1[r * h..(r + 1) * h].copy_from_slice(&w1[r * g * h + k * h..r * g * h + (k + 1) * h]);
                }
                x.b1.f32_mut()?.copy_from_slice(&b1[k * h..(k + 1) * h]);
                let xw2 = x.w2.f32_mut()?;
                xw2.iter_mut().zip(&w2[k * h * d..(k + 1) * h * d]).for_each(|(a, v)| *a = v * g as f32);
            }
        }
    }
    let own = &mut members[task].params;
    own.proj_w = view.params.proj_w.clone();
    own.proj_b = view.params.proj_b.clone();
    own.head_w = view.params.head_w.clone();
    own.head_b = view.params.head_b.clone();
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    use super::*;
    use crate::vmoe::VMoeConfig;

    fn perturbed(m: &VMoe, by: f32) -> VMoe {
        let mut m = m.clone();
        for blk in &mut m.params.blocks {
            for x in &mut blk.experts {
                x.w2.f32_mut()
                    .unwrap()
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v += by * ((i % 5) as f32 - 2.0));
                x.b2.f32_mut().unwrap().iter_mut().for_each(|v| *v += by);
            }
        }
        m
    }

    #[test]
    fn a_set_of_identical_copies_computes_what_one_copy_does() {
        let m = VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(4)).unwrap();
        let x = Tensor::from_f32(&[2, 64], (0..128).map(|i| (i % 9) as f32 / 9.0).collect()).unwrap();
        let one = m.forward(&x).unwrap().0.to_vec_f32();
        let view = group_view(&[&m, &m, &m], 1).unwrap();
        assert_eq!(view.config.hidden, 3 * m.config.hidden);
        let three = view.forward(&x).unwrap().0.to_vec_f32();
        assert!(one.iter().zip(&three).all(|(a, b)| (a - b).abs() < 1e-4), "{one:?} vs {three:?}");
    }

    #[test]
    fn the_set_is_the_mean_and_write_back_returns_only_writable_slices() {
        let m = VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(5)).unwrap();
        let (a, b) = (perturbed(&m, 0.01), perturbed(&m, -0.02));
        let view = group_view(&[&a, &b], 0).unwrap();
        // Down bias: mean of +0.01 and -0.02 shifts = -0.005 over the original.
        let got = view.params.blocks[0].experts[0].b2.to_vec_f32();
        let orig = m.params.blocks[0].experts[0].b2.to_vec_f32();
        assert!(got.iter().zip(&orig).all(|(g, o)| (g - (o - 0.005)).abs() < 1e-6));
        // Write back unchanged with only member 1 writable: member 1 recovers its own weights.
        let mut members = vec![m.clone(), m.clone()];
        write_back(&view, &mut members, 0, &[false, true]).unwrap();
        let w2 = |v: &VMoe| v.params.blocks[1].experts[3].w2.to_vec_f32();
        assert!(w2(&members[1]).iter().zip(&w2(&b)).all(|(x, y)| (x - y).abs() < 1e-6));
        assert_eq!(w2(&members[0]), w2(&m), "member 0 was not writable");
        assert!(write_back(&view, &mut members, 0, &[true]).is_err());
        assert!(group_view(&[], 0).is_err());
    }
}
