//! Roles: what a node certificate allows its holder to do.
//!
//! A certificate carries its roles as subject-alternative-name URIs `troupe-role:ROLE` (see
//! [`ROLE_URI_PREFIX`]). A role is a small closed set, so a [`RoleSet`] is a bit set.

use std::fmt;
use std::str::FromStr;

/// Prefix of the SAN URI that carries one role, e.g. `troupe-role:executor`.
pub const ROLE_URI_PREFIX: &str = "troupe-role:";

/// One role a certificate can grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Role {
    /// Runs a scheduler (CoE scheduler, pipeline foreman, co-adaptation scheduler).
    Scheduler = 0,
    /// Runs executors (CoE executors, hello experts).
    Executor = 1,
    /// A pipeline worker (a phone-class stage host).
    Worker = 2,
    /// A camera device of the co-adaptation workload.
    Camera = 3,
    /// The edge node of the co-adaptation workload.
    Edge = 4,
    /// An operator tool (`troupe status`): may query, may never join as a member.
    Admin = 5,
    /// A client of a serving scheduler (`troupe coe request`): may send requests, may never
    /// join as a member, and holds no right to command executors or workers.
    Client = 6,
}

impl Role {
    /// Every role, in a fixed order.
    pub const ALL: [Role; 7] =
        [Role::Scheduler, Role::Executor, Role::Worker, Role::Camera, Role::Edge, Role::Admin, Role::Client];

    /// The role's name as written on the command line and in certificates.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Scheduler => "scheduler",
            Role::Executor => "executor",
            Role::Worker => "worker",
            Role::Camera => "camera",
            Role::Edge => "edge",
            Role::Admin => "admin",
            Role::Client => "client",
        }
    }

    /// The SAN URI that carries this role.
    pub fn uri(self) -> String {
        format!("{ROLE_URI_PREFIX}{}", self.as_str())
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is not one of [`Role::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role {0:?} (known: scheduler, executor, worker, camera, edge, admin, client)")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| UnknownRole(s.to_string()))
    }
}

/// A set of roles (a bit per [`Role`]).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RoleSet(u8);

impl RoleSet {
    /// No role.
    pub const EMPTY: RoleSet = RoleSet(0);

    /// The set holding only `role`.
    pub const fn only(role: Role) -> Self {
        RoleSet(1 << role as u8)
    }

    /// This set plus `role`.
    pub const fn with(self, role: Role) -> Self {
        RoleSet(self.0 | 1 << role as u8)
    }

    /// Whether `role` is in the set.
    pub fn contains(self, role: Role) -> bool {
        self.0 & (1 << role as u8) != 0
    }

    /// Whether the two sets share a role.
    pub fn intersects(self, other: RoleSet) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The roles, in [`Role::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// Parses `scheduler,executor` (commas, surrounding spaces ignored; empty means no role).
    pub fn parse_list(s: &str) -> Result<Self, UnknownRole> {
        s.split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .try_fold(RoleSet::EMPTY, |set, r| Ok(set.with(r.parse()?)))
    }
}

impl FromIterator<Role> for RoleSet {
    fn from_iter<I: IntoIterator<Item = Role>>(iter: I) -> Self {
        iter.into_iter().fold(RoleSet::EMPTY, RoleSet::with)
    }
}

impl fmt::Display for RoleSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("(no role)");
        }
        let names: Vec<&str> = self.iter().map(Role::as_str).collect();
        f.write_str(&names.join(","))
    }
}

impl fmt::Debug for RoleSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RoleSet({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_lists_parse_and_print() {
        let s = RoleSet::parse_list("executor, scheduler").unwrap();
        assert!(s.contains(Role::Scheduler) && s.contains(Role::Executor) && !s.contains(Role::Admin));
        assert_eq!(s.to_string(), "scheduler,executor");
        assert_eq!(RoleSet::parse_list("").unwrap(), RoleSet::EMPTY);
        let e = RoleSet::parse_list("executor,wizard").unwrap_err();
        assert!(e.to_string().contains("wizard"), "{e}");
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>().unwrap(), r);
        }
    }
}
