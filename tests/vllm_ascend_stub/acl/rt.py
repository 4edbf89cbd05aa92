"""``acl.rt`` of the stand-in: ``memcpy`` only, refused when called."""


def memcpy(*args, **kwargs):
    from acl import StandInError

    raise StandInError("acl stand-in: acl.rt.memcpy was called")
