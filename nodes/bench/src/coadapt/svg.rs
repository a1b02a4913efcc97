//! The bench's SVG: SLO attainment against K, one panel per source (measured, simulated) side by
//! side, one polyline per strategy.

use super::SLO_RATIO;
use troupe::chart::{Curve, LineChart, render_row};

/// One chart: curves of (K, SLO attainment) points.
pub struct Panel<'a> {
    /// Title above the chart.
    pub title: &'a str,
    /// Largest K on the axis.
    pub k_max: usize,
    /// (strategy, points).
    pub curves: Vec<(&'a str, Vec<(usize, f64)>)>,
}

/// The panels side by side in one SVG, drawn by the benches' one chart ([`troupe::chart`]).
pub fn render_svg(panels: &[Panel<'_>]) -> String {
    let charts: Vec<LineChart> = panels
        .iter()
        .map(|p| {
            let k_max = p.k_max.max(2);
            let step = (k_max / 8).max(1);
            LineChart {
                title: p.title.to_string(),
                x_label: "K (concurrent tasks)".into(),
                x_range: (1.0, k_max as f64),
                x_ticks: (1..=k_max).step_by(step).map(|k| (k as f64, k.to_string())).collect(),
                reference: Some(SLO_RATIO),
                curves: p
                    .curves
                    .iter()
                    .map(|(name, pts)| Curve {
                        name: (*name).to_string(),
                        points: pts.iter().map(|(k, v)| (*k as f64, *v)).collect(),
                    })
                    .collect(),
                marks: Vec::new(),
            }
        })
        .collect();
    render_row(&charts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_one_polyline_per_curve_and_panels_side_by_side() {
        let measured = Panel { title: "measured", k_max: 4, curves: vec![("a", vec![(1, 1.0), (4, 0.5)])] };
        let sim = Panel {
            title: "sim",
            k_max: 2,
            curves: vec![("a", vec![(1, 1.0), (2, 0.5)]), ("b", vec![(1, 0.0), (2, 0.0)])],
        };
        let svg = render_svg(&[measured, sim]);
        assert_eq!(svg.matches("<polyline").count(), 3);
        // K = 1 at each panel's left edge, attainment 1.0 at the top; the second panel starts 720 px on.
        assert!(svg.contains("points=\"60.0,40.0 660.0,200.0\""), "{svg}");
        assert!(svg.contains("points=\"780.0,40.0 1380.0,200.0\""), "{svg}");
        assert!(svg.contains("width=\"1440\""));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
