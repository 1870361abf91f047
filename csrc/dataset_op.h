// The tfray source dataset kernel: batches from a native channel become
// tensors that alias the batch memory (see channel.h for who owns it).
#ifndef TFRAY_CSRC_DATASET_OP_H_
#define TFRAY_CSRC_DATASET_OP_H_

#include "tensorflow/core/framework/dataset.h"

namespace tfray {

class TfrayDatasetOp : public tensorflow::data::DatasetOpKernel {
 public:
  static constexpr const char* const kDatasetType = "Tfray";
  static constexpr const char* const kSourceKey = "source_key";
  static constexpr const char* const kOutputTypes = "output_types";
  static constexpr const char* const kOutputShapes = "output_shapes";

  explicit TfrayDatasetOp(tensorflow::OpKernelConstruction* ctx);

 protected:
  void MakeDataset(tensorflow::OpKernelContext* ctx,
                   tensorflow::data::DatasetBase** output) override;

 private:
  class Dataset;
  tensorflow::DataTypeVector output_types_;
  std::vector<tensorflow::PartialTensorShape> output_shapes_;
};

}  // namespace tfray

#endif  // TFRAY_CSRC_DATASET_OP_H_
