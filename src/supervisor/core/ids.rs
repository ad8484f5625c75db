//! The ids the core speaks in: numbers the supervisor hands out, one type per kind.

/// Declares a supervisor-internal id: a number that only means something as that kind of id,
/// so that one kind cannot be passed where another is wanted. A `counted` id is handed out by a
/// counter the core or the shell keeps; the others come from atomic counters (and, in tests,
/// from counters of the tests' own).
macro_rules! internal_id {
    (@type $(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub(crate) struct $name(pub(crate) u64);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    };
    (@counter $(#[$cfg:meta])? $name:ident) => {
        $(#[$cfg])?
        impl $name {
            /// This id, and moves the counter on to the next one.
            pub(crate) fn take(&mut self) -> Self {
                let id = *self;
                self.0 += 1;
                id
            }
        }
    };
    ($(#[$doc:meta])* $name:ident, counted) => {
        internal_id!(@type $(#[$doc])* $name);
        internal_id!(@counter $name);
    };
    ($(#[$doc:meta])* $name:ident) => {
        internal_id!(@type $(#[$doc])* $name);
        internal_id!(@counter #[cfg(test)] $name);
    };
}
internal_id!(
    /// Supervisor-internal key of one lease (not the broker's lease id).
    LeaseKey,
    counted
);
internal_id!(
    /// Supervisor-internal id of one waiting acquire.
    WaiterId
);
internal_id!(
    /// Supervisor-internal id of one broker acquire.
    RequestId,
    counted
);
internal_id!(
    /// Supervisor-internal id of one control call (cancel, resize, quarantine list, reclaim),
    /// to route its reply.
    ControlId,
    counted
);
internal_id!(
    /// Supervisor-internal id of one process group a job started.
    ProcessKey
);
