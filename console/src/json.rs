//! Serializers for the shared strings of the frames (`Arc<str>`), without serde's `rc`
//! feature (which would rebuild every serde user of the dependency tree a second time).

use std::sync::Arc;

use serde::Serializer;

pub(crate) fn arc_str<S: Serializer>(value: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(value)
}

pub(crate) fn opt_arc_str<S: Serializer>(
    value: &Option<Arc<str>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) => s.serialize_some(&**v),
        None => s.serialize_none(),
    }
}
