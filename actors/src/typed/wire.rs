//! What a typed message is: an rkyv value that crosses nodes through the runtime's one decode
//! path, with a name on the wire and a reply type.

use rkyv::api::high::{HighDeserializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::{Archive, Deserialize};

use crate::decode::{DecodeError, MAX_MESSAGE_BYTES, plain_budget};
use crate::service::BodySerializer;

/// A value that crosses nodes as an rkyv archive, read back with checked access under the
/// decoded-bytes budget ([`crate::decode`]). Implemented for every type that derives rkyv's
/// `Archive`, `Serialize` and `Deserialize` (with `bytecheck`), so it is never written by hand.
pub trait Wire: Sized + Send + 'static {
    /// The archive of `self`.
    fn to_wire(&self) -> Result<Vec<u8>, String>;
    /// `Self` from untrusted bytes: capped, budgeted, checked.
    fn from_wire(what: &'static str, bytes: &[u8]) -> Result<Self, DecodeError>;
}

impl<T> Wire for T
where
    T: Archive + for<'a> rkyv::Serialize<BodySerializer<'a>> + Send + 'static,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>>
        + Deserialize<T, HighDeserializer<rancor::Error>>,
{
    fn to_wire(&self) -> Result<Vec<u8>, String> {
        crate::service::to_body(self)
    }

    fn from_wire(what: &'static str, bytes: &[u8]) -> Result<Self, DecodeError> {
        crate::decode::decode::<T>(what, bytes, MAX_MESSAGE_BYTES, &mut plain_budget())
    }
}

/// A message a typed actor accepts: its name on the wire (unique within the actor's kind, at
/// most 64 bytes, not starting with `@`) and the type of its reply (`()` for a tell).
///
/// ```
/// use troupe_actors::typed::RemoteMessage;
///
/// #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
/// pub struct Add(pub u64);
///
/// impl RemoteMessage for Add {
///     const NAME: &'static str = "add";
///     type Reply = u64;
/// }
/// ```
pub trait RemoteMessage: Wire {
    /// The message's name on the wire and in errors.
    const NAME: &'static str;
    /// What a call of it answers.
    type Reply: Wire;
}
