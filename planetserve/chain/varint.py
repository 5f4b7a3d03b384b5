"""Unsigned varints (protobuf's base-128), shared by the ABCI framing and the light client's
length-delimited vote encoding."""


def encode_uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
