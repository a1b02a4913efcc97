//! Roles: what a node certificate allows its holder to do.
//!
//! A certificate carries its roles as subject-alternative-name URIs `troupe-role:ROLE` (see
//! [`ROLE_URI_PREFIX`]). Seven roles are built in ([`Role::BUILT_IN`]); any other name that
//! passes [`validate_role_name`] may be used too (`troupe keys node NAME --role my-app`, an actor
//! kind's own `Allow::role(Role::named("my-app")?)`).
//!
//! A [`Role`] is a small index into a process-wide table of names, so that a [`RoleSet`] stays
//! a `Copy` bit set checked on every request. The table holds the built-ins and the names this
//! process interned from local input ([`Role::named`], `FromStr`): at most [`MAX_ROLES`].
//!
//! Security: a peer's certificate never adds names to the table. Its role names are mapped to
//! the roles this process already knows ([`Role::known`]); the others grant nothing, since no
//! local rule mentions them, and an attacker holding a valid certificate full of made-up roles
//! cannot exhaust the table. They are kept aside on the parsed certificate (bounded) and looked
//! up again when the peer's roles are checked ([`crate::CertInfo::current_roles`]), so a rule
//! that names a role after the peer connected still sees it.

use std::fmt;
use std::str::FromStr;
use std::sync::{PoisonError, RwLock};

/// Prefix of the SAN URI that carries one role, e.g. `troupe-role:executor`.
pub const ROLE_URI_PREFIX: &str = "troupe-role:";

/// Most roles (built-in and named) one process can know: a [`RoleSet`] is a 64-bit set.
pub const MAX_ROLES: usize = 64;

/// Longest role name, in bytes.
pub const MAX_ROLE_NAME: usize = 32;

/// Names of the built-in roles, by index.
const BUILT_IN_NAMES: [&str; 7] = ["scheduler", "executor", "worker", "camera", "edge", "admin", "client"];

/// Names interned beyond the built-ins, by index minus the built-ins' count (leaked: at most
/// `MAX_ROLES` short strings per process, so that [`Role::as_str`] can give `&'static str`).
struct NameTable(RwLock<Vec<&'static str>>);

impl NameTable {
    const fn new() -> Self {
        NameTable(RwLock::new(Vec::new()))
    }

    /// The index of `name`, built in or interned before.
    fn lookup(&self, name: &str) -> Option<u8> {
        if let Some(i) = BUILT_IN_NAMES.iter().position(|n| *n == name) {
            return Some(i as u8);
        }
        let named = self.0.read().unwrap_or_else(PoisonError::into_inner);
        named.iter().position(|n| *n == name).map(|i| (BUILT_IN_NAMES.len() + i) as u8)
    }

    /// The index of `name` (a valid role name), interning it if it is new.
    fn intern(&self, name: &str) -> Result<u8, RoleError> {
        if let Some(i) = self.lookup(name) {
            return Ok(i);
        }
        let mut named = self.0.write().unwrap_or_else(PoisonError::into_inner);
        // another thread may have added it between the lookup and the write lock
        if let Some(i) = named.iter().position(|n| *n == name) {
            return Ok((BUILT_IN_NAMES.len() + i) as u8);
        }
        let index = BUILT_IN_NAMES.len() + named.len();
        if index >= MAX_ROLES {
            return Err(RoleError::TooMany(name.to_string()));
        }
        named.push(Box::leak(name.to_string().into_boxed_str()));
        Ok(index as u8)
    }

    /// The name at `index`.
    fn name(&self, index: u8) -> Option<&'static str> {
        let i = usize::from(index);
        if let Some(name) = BUILT_IN_NAMES.get(i) {
            return Some(name);
        }
        let named = self.0.read().unwrap_or_else(PoisonError::into_inner);
        named.get(i - BUILT_IN_NAMES.len()).copied()
    }
}

/// This process's roles.
static NAMES: NameTable = NameTable::new();

/// Why a role name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoleError {
    /// The name breaks the role-name rule.
    #[error(
        "invalid role name {0:?}: a role is 1-32 characters of a-z, 0-9 and '-', starting with a letter (built in: scheduler, executor, worker, camera, edge, admin, client)"
    )]
    InvalidName(String),
    /// The process already knows [`MAX_ROLES`] roles.
    #[error("cannot add role {0:?}: this process already knows {MAX_ROLES} roles, the most it can hold")]
    TooMany(String),
}

/// Checks that `name` can be a role: `[a-z][a-z0-9-]{0,31}`.
pub fn validate_role_name(name: &str) -> Result<(), RoleError> {
    let mut bytes = name.bytes();
    let ok = name.len() <= MAX_ROLE_NAME
        && bytes.next().is_some_and(|b| b.is_ascii_lowercase())
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok { Ok(()) } else { Err(RoleError::InvalidName(name.to_string())) }
}

/// One role a certificate can grant: a built-in (the associated constants) or a name this
/// process interned ([`Role::named`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Role(u8);

#[allow(non_upper_case_globals)] // the built-ins keep the names they had as enum variants
impl Role {
    /// Runs a scheduler (CoE scheduler, pipeline foreman, co-adaptation scheduler).
    pub const Scheduler: Role = Role(0);
    /// Runs executors (CoE executors, hello experts).
    pub const Executor: Role = Role(1);
    /// A pipeline worker (a phone-class stage host).
    pub const Worker: Role = Role(2);
    /// A camera device of the co-adaptation workload.
    pub const Camera: Role = Role(3);
    /// The edge node of the co-adaptation workload.
    pub const Edge: Role = Role(4);
    /// An operator tool (`troupe status`): may query, may never join as a member.
    pub const Admin: Role = Role(5);
    /// A client of a cluster's services (`troupe coe request`, `troupe pipeline submit`): may
    /// send requests and submit jobs, may never join as a member, and holds no right to command
    /// executors or workers.
    pub const Client: Role = Role(6);

    /// The built-in roles, in a fixed order.
    pub const BUILT_IN: [Role; 7] =
        [Role::Scheduler, Role::Executor, Role::Worker, Role::Camera, Role::Edge, Role::Admin, Role::Client];

    /// The role called `name` from local input (command line, config, an actor kind's rules):
    /// a built-in, a name interned before, or a new one. Refuses a name that breaks
    /// [`validate_role_name`] and a new name beyond [`MAX_ROLES`]. Never call this with a name
    /// a peer sent (use [`Role::known`]).
    pub fn named(name: &str) -> Result<Role, RoleError> {
        validate_role_name(name)?;
        NAMES.intern(name).map(Role)
    }

    /// The role called `name` if this process already knows it (`None` otherwise); never adds
    /// a name, so it is the lookup for names from peers' certificates.
    pub fn known(name: &str) -> Option<Role> {
        NAMES.lookup(name).map(Role)
    }

    /// The role's name as written on the command line and in certificates.
    pub fn as_str(self) -> &'static str {
        // a Role past the built-ins is only made by `intern`, which stored its name first
        NAMES.name(self.0).unwrap_or("?")
    }

    /// Whether this is one of [`Role::BUILT_IN`].
    pub fn is_built_in(self) -> bool {
        usize::from(self.0) < BUILT_IN_NAMES.len()
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

impl fmt::Debug for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Role({})", self.as_str())
    }
}

impl FromStr for Role {
    type Err = RoleError;

    /// [`Role::named`]: for local input only (it may add the name to this process's roles).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::named(s)
    }
}

/// A set of roles (a bit per [`Role`]).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RoleSet(u64);

impl RoleSet {
    /// No role.
    pub const EMPTY: RoleSet = RoleSet(0);

    /// The set holding only `role`.
    pub const fn only(role: Role) -> Self {
        RoleSet(1 << role.0)
    }

    /// This set plus `role`.
    pub const fn with(self, role: Role) -> Self {
        RoleSet(self.0 | 1 << role.0)
    }

    /// Whether `role` is in the set.
    pub fn contains(self, role: Role) -> bool {
        self.0 & (1 << role.0) != 0
    }

    /// Whether the two sets share a role.
    pub fn intersects(self, other: RoleSet) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The roles: the built-ins in [`Role::BUILT_IN`] order, then named ones in the order
    /// this process learnt them.
    pub fn iter(self) -> impl Iterator<Item = Role> {
        (0..MAX_ROLES as u8).map(Role).filter(move |r| self.contains(*r))
    }

    /// Parses `scheduler,my-app` from local input (commas, surrounding spaces ignored; empty
    /// means no role); names that are not built in are interned as by [`Role::named`].
    pub fn parse_list(s: &str) -> Result<Self, RoleError> {
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
        let e = RoleSet::parse_list("executor,Wizard").unwrap_err();
        assert_eq!(e, RoleError::InvalidName("Wizard".to_string()));
        assert!(e.to_string().contains("\"Wizard\"") && e.to_string().contains("a-z"), "{e}");
        for r in Role::BUILT_IN {
            assert_eq!(r.as_str().parse::<Role>().unwrap(), r);
            assert!(r.is_built_in());
        }
        // the built-ins are still usable as patterns
        assert!(matches!(Role::named("client").unwrap(), Role::Client));
    }

    #[test]
    fn names_follow_the_charset() {
        for good in ["a", "my-app", "x9", "a-", &"r".repeat(MAX_ROLE_NAME)] {
            assert!(validate_role_name(good).is_ok(), "{good:?}");
        }
        for bad in
            ["", "-a", "9a", "My-app", "my_app", "my app", "my.app", "é", &"r".repeat(MAX_ROLE_NAME + 1)]
        {
            assert_eq!(validate_role_name(bad), Err(RoleError::InvalidName(bad.to_string())), "{bad:?}");
            assert!(Role::named(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn named_roles_are_interned_once_and_print_their_name() {
        let a = Role::named("roles-test-app").unwrap();
        assert!(!a.is_built_in());
        assert_eq!(Role::named("roles-test-app").unwrap(), a);
        assert_eq!(Role::known("roles-test-app"), Some(a));
        assert_eq!(a.as_str(), "roles-test-app");
        assert_eq!(a.uri(), "troupe-role:roles-test-app");
        let set = RoleSet::parse_list("roles-test-app,camera").unwrap();
        assert!(set.contains(a) && set.contains(Role::Camera) && !set.contains(Role::Client));
        assert_eq!(set.to_string(), "camera,roles-test-app");
        assert!(!RoleSet::only(a).intersects(RoleSet::only(Role::Scheduler)));
    }

    #[test]
    fn known_never_interns() {
        assert_eq!(Role::known("roles-test-never-named"), None);
        assert_eq!(Role::known("roles-test-never-named"), None);
        assert_eq!(Role::known("admin"), Some(Role::Admin));
        assert_eq!(Role::known("Bad Name"), None);
    }

    #[test]
    fn the_table_is_capped_with_a_named_error() {
        // a table of its own: the process-wide one is shared with the other tests
        let table = NameTable::new();
        let free = MAX_ROLES - BUILT_IN_NAMES.len();
        for i in 0..free {
            assert_eq!(table.intern(&format!("cap-{i}")), Ok((BUILT_IN_NAMES.len() + i) as u8));
        }
        let e = table.intern("one-too-many").unwrap_err();
        assert_eq!(e, RoleError::TooMany("one-too-many".to_string()));
        assert!(e.to_string().contains("\"one-too-many\"") && e.to_string().contains("64"), "{e}");
        // what is known still resolves, without taking room
        assert_eq!(table.intern("cap-3"), Ok(BUILT_IN_NAMES.len() as u8 + 3));
        assert_eq!(table.intern("client"), Ok(Role::Client.0));
        assert_eq!(table.name(MAX_ROLES as u8 - 1), Some(format!("cap-{}", free - 1)).as_deref());
        assert_eq!(table.lookup("one-too-many"), None);
    }
}
