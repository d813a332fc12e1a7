"""Generated protobuf messages of lr (``lr_pb2``, from ``proto/lr.proto``)."""
