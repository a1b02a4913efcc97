//! A CoE workload trace: the model, the requests with their arrival times, and which subsequent
//! experts each preliminary selects for each request (what real execution decided, recorded so
//! a simulation can replay it). Line-based text format, parsed strictly as untrusted input.
//!
//! ```text
//! format troupe-coe-trace 1
//! expert <id> size <bytes> prob <p> home host|ssd [parent <id>]     # ids 0, 1, 2, ... in order
//! request <id> arrival <micros> input <u64> root <expert>           # ids 0, 1, 2, ... in order
//! select <request> <expert> [<selected expert> ...]                 # after its request line
//! ```
//!
//! Every expert with subsequent experts that a request reaches needs exactly one `select` line
//! for that request (an empty selection ends the walk there).

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::model::{CoeModel, ExpertId, ExpertSpec, MAX_EXPERTS, RequestId, Tier};
use super::text::{self, Line, ParseError};
use crate::Micros;

/// First line of every trace file.
pub const FORMAT_LINE: &str = "format troupe-coe-trace 1";
/// Largest trace text accepted, in bytes.
pub const MAX_TRACE_BYTES: usize = 256 << 20;
/// Most requests in one trace.
pub const MAX_REQUESTS: usize = 1_000_000;
/// Most meaningful lines in one trace.
pub const MAX_TRACE_LINES: usize = 8_000_000;
/// Most experts one `select` line may name.
pub const MAX_SELECTED: usize = 256;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Its id (equal to its index in the trace).
    pub id: RequestId,
    /// When it arrives.
    pub arrival: Micros,
    /// Stand-in for the request's input data (seeds the simulated expert outputs).
    pub input: u64,
    /// The preliminary expert it enters at.
    pub root: ExpertId,
    /// For each expert with subsequent experts that it reaches: the experts selected.
    pub selections: Vec<(ExpertId, Vec<ExpertId>)>,
}

impl TraceRequest {
    /// The experts `expert`'s output selected for this request (`None` if it has no entry).
    pub fn selection(&self, expert: ExpertId) -> Option<&[ExpertId]> {
        self.selections.iter().find(|(x, _)| *x == expert).map(|(_, s)| s.as_slice())
    }

    /// Every expert this request runs: the root and everything selected below it.
    pub fn experts(&self) -> Vec<ExpertId> {
        let mut out = vec![self.root];
        for (_, selected) in &self.selections {
            out.extend(selected.iter().copied());
        }
        out
    }
}

/// A model and the requests to replay on it.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// The CoE application.
    pub model: CoeModel,
    /// Requests in arrival order, ids 0, 1, 2, ...
    pub requests: Vec<TraceRequest>,
}

/// Why a trace was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TraceError {
    /// Malformed or inconsistent text.
    #[error("trace: {0}")]
    Parse(#[from] ParseError),
    /// A trace built in code is inconsistent.
    #[error("trace: request {request}: {problem}")]
    Invalid {
        /// The request.
        request: RequestId,
        /// What is wrong.
        problem: String,
    },
}

/// Check one request's walk against the model: it enters at a root, every selection comes from
/// an expert it reached, selected experts depend on their selector, and every reached expert with
/// subsequent experts has exactly one selection.
fn check_request(model: &CoeModel, r: &TraceRequest) -> Result<(), String> {
    let root = model.expert(r.root).ok_or_else(|| format!("root {} is not in the model", r.root))?;
    if root.preliminary().is_some() {
        return Err(format!("root {} is not a preliminary expert", r.root));
    }
    let mut reached = BTreeSet::from([r.root]);
    let mut selected_from = BTreeSet::new();
    for (expert, selected) in &r.selections {
        if !reached.contains(expert) {
            return Err(format!("selection from {expert}, which the request has not reached"));
        }
        if !selected_from.insert(*expert) {
            return Err(format!("two selections from {expert}"));
        }
        if selected.len() > MAX_SELECTED {
            return Err(format!("more than {MAX_SELECTED} experts selected by {expert}"));
        }
        for child in selected {
            if !model.is_child_of(*child, *expert) {
                return Err(format!("{child} is not a subsequent expert of {expert}"));
            }
            if !reached.insert(*child) {
                return Err(format!("{child} selected twice"));
            }
        }
    }
    for expert in &reached {
        if model.expert(*expert).is_some_and(|e| e.has_children()) && !selected_from.contains(expert) {
            return Err(format!("no selection from {expert}, which the request reaches"));
        }
    }
    Ok(())
}

impl Trace {
    /// Check a trace built in code (the parser checks the same things with line numbers).
    pub fn validate(&self) -> Result<(), TraceError> {
        if self.requests.len() > MAX_REQUESTS {
            return Err(TraceError::Invalid {
                request: RequestId(MAX_REQUESTS as u64),
                problem: format!("more than {MAX_REQUESTS} requests"),
            });
        }
        let mut last = Micros::ZERO;
        for (i, r) in self.requests.iter().enumerate() {
            let invalid = |problem: String| TraceError::Invalid { request: r.id, problem };
            if r.id != RequestId(i as u64) {
                return Err(invalid(format!("id should be r{i}, its position")));
            }
            if r.arrival < last {
                return Err(invalid("arrives before the previous request".into()));
            }
            last = r.arrival;
            check_request(&self.model, r).map_err(invalid)?;
        }
        Ok(())
    }

    /// Write the trace in the text format [`Trace::parse`] reads.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        out.push_str(FORMAT_LINE);
        out.push('\n');
        for e in self.model.experts() {
            let _ =
                write!(out, "expert {} size {} prob {} home {}", e.id.0, e.size_bytes, e.select_prob, e.home);
            if let Some(p) = e.preliminary() {
                let _ = write!(out, " parent {}", p.0);
            }
            out.push('\n');
        }
        for r in &self.requests {
            let _ = writeln!(
                out,
                "request {} arrival {} input {} root {}",
                r.id.0, r.arrival.0, r.input, r.root.0
            );
            for (expert, selected) in &r.selections {
                let _ = write!(out, "select {} {}", r.id.0, expert.0);
                for s in selected {
                    let _ = write!(out, " {}", s.0);
                }
                out.push('\n');
            }
        }
        out
    }

    /// Parse and validate a trace file.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        text::check_size(text, MAX_TRACE_BYTES)?;
        let lines = text::lines(text, MAX_TRACE_LINES)?;
        let mut iter = lines.iter().peekable();
        let first = iter.next().ok_or_else(|| ParseError::new(0, "format", "the file is empty"))?;
        if first.tokens.join(" ") != FORMAT_LINE {
            return Err(ParseError::new(first.number, "format", format!("expected `{FORMAT_LINE}`")).into());
        }
        let mut specs: Vec<ExpertSpec> = Vec::new();
        let mut spec_lines: Vec<usize> = Vec::new();
        while let Some(line) = iter.next_if(|l| l.key() == "expert") {
            if specs.len() >= MAX_EXPERTS {
                return Err(ParseError::new(line.number, "expert", "too many experts").into());
            }
            specs.push(parse_expert(line, specs.len())?);
            spec_lines.push(line.number);
        }
        let model = CoeModel::new(specs).map_err(|err| {
            let index = match &err {
                super::model::ModelError::BadSize { index, .. }
                | super::model::ModelError::BadProbability { index, .. }
                | super::model::ModelError::BadParent { index, .. }
                | super::model::ModelError::TooDeep { index } => Some(*index),
                _ => None,
            };
            let line = index.and_then(|i| spec_lines.get(i).copied()).unwrap_or(0);
            ParseError::new(line, "expert", err.to_string())
        })?;
        let mut requests: Vec<TraceRequest> = Vec::new();
        let mut request_line = 0usize;
        for line in iter {
            match line.key() {
                "request" => {
                    if let Some(previous) = requests.last() {
                        check_request(&model, previous)
                            .map_err(|p| ParseError::new(request_line, "select", p))?;
                    }
                    if requests.len() >= MAX_REQUESTS {
                        return Err(ParseError::new(line.number, "request", "too many requests").into());
                    }
                    let r = parse_request(line, &model, requests.len(), requests.last())?;
                    request_line = line.number;
                    requests.push(r);
                }
                "select" => {
                    let current = requests
                        .last_mut()
                        .ok_or_else(|| ParseError::new(line.number, "select", "comes before any request"))?;
                    parse_select(line, &model, current)?;
                }
                "expert" => {
                    return Err(ParseError::new(
                        line.number,
                        "expert",
                        "expert lines must all come before the first request",
                    )
                    .into());
                }
                other => return Err(ParseError::new(line.number, other, "unknown key").into()),
            }
        }
        if let Some(last) = requests.last() {
            check_request(&model, last).map_err(|p| ParseError::new(request_line, "select", p))?;
        }
        Ok(Trace { model, requests })
    }
}

fn parse_expert(line: &Line<'_>, index: usize) -> Result<ExpertSpec, ParseError> {
    if line.tokens.len() != 8 && line.tokens.len() != 10 {
        return Err(ParseError::new(
            line.number,
            "expert",
            "expected `expert <id> size <bytes> prob <p> home <tier> [parent <id>]`",
        ));
    }
    let id: u64 = line.number(1, "expert", 0, u64::MAX)?;
    if id != index as u64 {
        return Err(ParseError::new(line.number, "expert", format!("id should be {index}")));
    }
    line.expect_word(2, "size")?;
    let size_bytes = line.number(3, "size", 1, super::model::MAX_EXPERT_BYTES)?;
    line.expect_word(4, "prob")?;
    let select_prob = line.number(5, "prob", 0.0, 1.0)?;
    line.expect_word(6, "home")?;
    let tier = line.token(7, "home")?;
    let home = Tier::from_name(tier).ok_or_else(|| {
        ParseError::new(line.number, "home", format!("`{tier}` is not a tier (host or ssd)"))
    })?;
    let parent = if line.tokens.len() == 10 {
        line.expect_word(8, "parent")?;
        let p: u32 = line.number(9, "parent", 0, u32::MAX)?;
        Some(ExpertId(p))
    } else {
        None
    };
    Ok(ExpertSpec { size_bytes, select_prob, home, parent })
}

fn parse_request(
    line: &Line<'_>,
    model: &CoeModel,
    index: usize,
    previous: Option<&TraceRequest>,
) -> Result<TraceRequest, ParseError> {
    line.expect_len(8)?;
    let id: u64 = line.number(1, "request", 0, u64::MAX)?;
    if id != index as u64 {
        return Err(ParseError::new(line.number, "request", format!("id should be {index}")));
    }
    line.expect_word(2, "arrival")?;
    let arrival = Micros(line.number(3, "arrival", 0, u64::MAX)?);
    if previous.is_some_and(|p| p.arrival > arrival) {
        return Err(ParseError::new(line.number, "arrival", "earlier than the previous request"));
    }
    line.expect_word(4, "input")?;
    let input = line.number(5, "input", 0, u64::MAX)?;
    line.expect_word(6, "root")?;
    let root = ExpertId(line.number(7, "root", 0, u32::MAX)?);
    match model.expert(root) {
        None => {
            return Err(ParseError::new(line.number, "root", format!("{root} is not in the model")));
        }
        Some(e) if e.preliminary().is_some() => {
            return Err(ParseError::new(line.number, "root", format!("{root} is not preliminary")));
        }
        Some(_) => {}
    }
    Ok(TraceRequest { id: RequestId(id), arrival, input, root, selections: Vec::new() })
}

fn parse_select(line: &Line<'_>, model: &CoeModel, current: &mut TraceRequest) -> Result<(), ParseError> {
    if line.tokens.len() < 3 || line.tokens.len() > 3 + MAX_SELECTED {
        return Err(ParseError::new(
            line.number,
            "select",
            format!("expected `select <request> <expert>` and 0..={MAX_SELECTED} experts"),
        ));
    }
    let request: u64 = line.number(1, "select", 0, u64::MAX)?;
    if request != current.id.0 {
        return Err(ParseError::new(
            line.number,
            "select",
            format!("names request {request}; selections must follow their request ({})", current.id),
        ));
    }
    let expert = ExpertId(line.number(2, "select", 0, u32::MAX)?);
    if model.expert(expert).is_none() {
        return Err(ParseError::new(line.number, "select", format!("{expert} is not in the model")));
    }
    let mut selected = Vec::with_capacity(line.tokens.len() - 3);
    for i in 3..line.tokens.len() {
        let child = ExpertId(line.number(i, "select", 0, u32::MAX)?);
        if !model.is_child_of(child, expert) {
            return Err(ParseError::new(
                line.number,
                "select",
                format!("{child} is not a subsequent expert of {expert}"),
            ));
        }
        selected.push(child);
    }
    current.selections.push((expert, selected));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
format troupe-coe-trace 1
# two roots; e0 selects among e2, e3; e2 selects e4
expert 0 size 100 prob 0.7 home ssd
expert 1 size 200 prob 0.3 home host
expert 2 size 50 prob 0.6 home ssd parent 0
expert 3 size 50 prob 0.4 home ssd parent 0
expert 4 size 10 prob 1 home ssd parent 2
request 0 arrival 0 input 11 root 0
select 0 0 2 3
select 0 2 4
request 1 arrival 5 input 12 root 1
request 2 arrival 5 input 13 root 0
select 2 0
";

    #[test]
    fn parses_and_round_trips() {
        let t = Trace::parse(SAMPLE).unwrap();
        assert_eq!(t.model.len(), 5);
        assert_eq!(t.model.depth(), 3);
        assert_eq!(t.requests.len(), 3);
        assert_eq!(t.requests[0].selection(ExpertId(0)), Some(&[ExpertId(2), ExpertId(3)][..]));
        assert_eq!(t.requests[0].experts(), vec![ExpertId(0), ExpertId(2), ExpertId(3), ExpertId(4)]);
        assert_eq!(t.requests[2].selection(ExpertId(0)), Some(&[][..]));
        t.validate().unwrap();
        assert_eq!(Trace::parse(&t.to_text()).unwrap(), t);
    }

    fn error_of(text: &str) -> ParseError {
        match Trace::parse(text) {
            Err(TraceError::Parse(e)) => e,
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    #[test]
    fn errors_name_the_line() {
        let e = error_of(&SAMPLE.replace("select 0 0 2 3", "select 0 0 2 4"));
        assert_eq!((e.line, e.field.as_str()), (9, "select"));
        // A reached expert with children but no selection: reported at its request line.
        let e = error_of(&SAMPLE.replace("select 0 2 4\n", ""));
        assert_eq!(e.line, 8);
        assert!(e.problem.contains("no selection from e2"), "{e}");
        let e = error_of(&SAMPLE.replace("request 2 arrival 5", "request 2 arrival 4"));
        assert_eq!((e.line, e.field.as_str()), (12, "arrival"));
        let e = error_of(&SAMPLE.replace("root 1", "root 2"));
        assert_eq!((e.line, e.field.as_str()), (11, "root"));
        let e = error_of(&SAMPLE.replace("expert 4 size 10 prob 1", "expert 4 size 10 prob 1.5"));
        assert_eq!((e.line, e.field.as_str()), (7, "prob"));
        let e = error_of(&SAMPLE.replace("parent 2", "parent 9"));
        assert_eq!((e.line, e.field.as_str()), (7, "expert"));
        let e = error_of(&SAMPLE.replace("request 1 arrival", "request 7 arrival"));
        assert_eq!((e.line, e.field.as_str()), (11, "request"));
        let e = error_of(&SAMPLE.replace("select 2 0", "select 1 0"));
        assert_eq!((e.line, e.field.as_str()), (13, "select"));
        let e = error_of(&format!("{SAMPLE}expert 5 size 1 prob 1 home ssd\n"));
        assert_eq!((e.line, e.field.as_str()), (14, "expert"));
        let e = error_of(&SAMPLE.replace("select 0 2 4", "select 0 2 4\nselect 0 2 4"));
        assert!(e.problem.contains("two selections"), "{e}");
    }

    #[test]
    fn validate_catches_programmatic_mistakes() {
        let mut t = Trace::parse(SAMPLE).unwrap();
        t.requests[1].selections.push((ExpertId(0), vec![]));
        assert!(matches!(t.validate(), Err(TraceError::Invalid { request: RequestId(1), .. })));
    }
}
