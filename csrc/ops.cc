// The op's interface. Its kernel is in dataset_op.cc.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"

REGISTER_OP("TfrayDataset")
    // A key into the process's tfray source registry, not a pointer: the
    // serialized graph can be re-instantiated anywhere in this process.
    .Input("source_key: int64")
    .Output("handle: variant")
    .Attr("output_types: list(type) >= 1")
    .Attr("output_shapes: list(shape) >= 1")
    .Attr("metadata: string = ''")
    // Each iterator reads from Ray: never fold, dedupe or hoist it.
    .SetIsStateful()
    .SetDoNotOptimize()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);
