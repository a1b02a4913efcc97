//! troupe's actors: supervision, membership, and the four actor kinds (device, expert, buffer,
//! scheduler). Decisions live in `troupe-policy`; these are the shells that carry them out.
