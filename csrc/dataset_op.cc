#include "dataset_op.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "batch_buffer.h"
#include "channel.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/dataset_options.pb.h"
#include "tensorflow/core/framework/model.h"
#include "tensorflow/core/framework/partial_tensor_shape.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"
#include "tf_compat.h"
#include "tsl/profiler/lib/traceme.h"

namespace tfray {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::DataTypeVector;
using ::tensorflow::Node;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::PartialTensorShape;
using ::tensorflow::Tensor;
using ::tensorflow::TensorBuffer;
using ::tensorflow::TensorShape;
using ::tensorflow::data::DatasetBase;
using ::tensorflow::data::DatasetContext;
using ::tensorflow::data::DatasetIterator;
using ::tensorflow::data::IteratorBase;
using ::tensorflow::data::IteratorContext;
using ::tensorflow::data::IteratorStateReader;
using ::tensorflow::data::IteratorStateWriter;
using ::tensorflow::data::SerializationContext;
using ::tensorflow::data::model::MakeSourceNode;

namespace {

absl::Status ToStatus(Code code, const std::string& message) {
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

}  // namespace

class TfrayDatasetOp::Dataset : public DatasetBase {
 public:
  Dataset(OpKernelContext* ctx, int64_t key, SourceRegistry::SourceInfo info,
          DataTypeVector output_types,
          std::vector<PartialTensorShape> output_shapes)
      : DatasetBase(DatasetContext(ctx)),
        key_(key),
        info_(info),
        output_types_(std::move(output_types)),
        output_shapes_(std::move(output_shapes)) {
    // tfray shards at the source (each worker reads only its share), so
    // tf.data's auto-shard must not add DATA sharding on top: that would
    // make each worker produce every batch and drop (n-1)/n of them. Options
    // set downstream by the user still take precedence.
    tensorflow::data::Options options;
    options.mutable_distribute_options()->set_auto_shard_policy(
        tensorflow::data::AutoShardPolicy::OFF);
    set_options(options);
  }

  std::unique_ptr<IteratorBase> MakeIteratorInternal(
      const std::string& prefix) const override {
    return std::make_unique<Iterator>(
        Iterator::Params{this, absl::StrCat(prefix, "::", kDatasetType)});
  }

  const DataTypeVector& output_dtypes() const override {
    return output_types_;
  }
  const std::vector<PartialTensorShape>& output_shapes() const override {
    return output_shapes_;
  }

  std::string DebugString() const override {
    return absl::StrCat("TfrayDatasetOp(source_key=", key_, ")::Dataset");
  }

  int64_t CardinalityInternal(
      tensorflow::data::CardinalityOptions options) const override {
    return info_.cardinality;
  }

  absl::Status InputDatasets(
      std::vector<const DatasetBase*>* inputs) const override {
    return absl::OkStatus();
  }

  // The batches live in Ray, outside the graph; the graph holds only the
  // source key, which names them within this process. That is enough for
  // the graph rewrites tf.data and tf.distribute apply in process, and for
  // iterator checkpoints, whose state is a position (see SaveInternal).
  absl::Status CheckExternalState() const override {
    return absl::OkStatus();
  }

 protected:
  absl::Status AsGraphDefInternal(SerializationContext* ctx,
                                  DatasetGraphDefBuilder* b,
                                  Node** output) const override {
    Node* key = nullptr;
    TF_RETURN_IF_ERROR(b->AddScalar(key_, &key));
    return b->AddDataset(this, {key}, output);
  }

 private:
  class Iterator : public DatasetIterator<Dataset> {
   public:
    explicit Iterator(const Params& params)
        : DatasetIterator<Dataset>(params),
          reading_(std::make_shared<Reading>()) {}

    ~Iterator() override {
      if (deregister_fn_) deregister_fn_();
      // Tells the feeder to stop and drops queued batches; tensors already
      // handed out keep their batches alive through their release tokens.
      reading_->Cancel();
    }

    absl::Status Initialize(IteratorContext* ctx) override {
      SourceRegistry::SourceInfo info;
      if (!SourceRegistry::Global().Lookup(dataset()->key_, &info)) {
        return NotRegistered();
      }
      const tensorflow::data::Options* options =
          compat::PipelineOptions(ctx, this);
      deterministic_ = options == nullptr || !options->has_deterministic() ||
                       options->deterministic();
      return tensorflow::RegisterCancellationCallback(
          ctx->cancellation_manager(),
          [reading = reading_]() { reading->Cancel(); }, &deregister_fn_);
    }

    absl::Status GetNextInternal(IteratorContext* ctx,
                                 std::vector<Tensor>* out_tensors,
                                 bool* end_of_sequence) override {
      std::shared_ptr<Channel> channel;
      {
        tensorflow::mutex_lock l(mu_);
        if (exhausted_) {
          *end_of_sequence = true;
          return absl::OkStatus();
        }
        // Each iterator is one epoch. It is asked for at the first GetNext,
        // not in Initialize, so a restored iterator asks for it from its
        // saved position, and an iterator never read starts no producers.
        if (channel_ == nullptr) {
          SourceRegistry::Request request{
              dataset()->key_,
              std::make_shared<Channel>(dataset()->info_.capacity),
              deterministic_, position_, progress_.Encode(), resume_info_};
          if (!SourceRegistry::Global().RequestEpoch(std::move(request),
                                                     &channel_)) {
            return NotRegistered();
          }
          reading_->Set(channel_);
        }
        channel = channel_;
      }
      // The wait holds no lock, so a checkpoint's Save need not wait for
      // the next batch; and it is not work, for tf.data's autotune model,
      // which hears of it (as its trace does) only when there is one.
      Batch batch;
      Code code = Code::kOk;
      std::string message;
      Channel::PopResult result =
          channel->Pop(&batch, &code, &message, /*wait=*/false);
      if (result == Channel::PopResult::kEmpty) {
        tsl::profiler::TraceMe trace("TfrayWaitForBatch");
        RecordStop(ctx);
        result = channel->Pop(&batch, &code, &message);
        RecordStart(ctx);
      }
      tensorflow::mutex_lock l(mu_);
      switch (result) {
        case Channel::PopResult::kEnd:
          exhausted_ = true;
          *end_of_sequence = true;
          return absl::OkStatus();
        case Channel::PopResult::kCancelled:
          return absl::CancelledError("tfray iterator was cancelled");
        case Channel::PopResult::kError:
          ++position_;  // An error takes its batch's place in the epoch.
          return ToStatus(code, message);
        case Channel::PopResult::kBatch:
        case Channel::PopResult::kEmpty:  // Not after a waiting Pop.
          break;
      }
      // Counted once handed out: a Save during the wait saves the position
      // before this batch, which a restored iterator then delivers.
      ++position_;
      progress_.Took(batch.origin);
      *end_of_sequence = false;
      return ToTensors(batch, out_tensors);
    }

   protected:
    std::shared_ptr<tensorflow::data::model::Node> CreateNode(
        IteratorContext* ctx,
        tensorflow::data::model::Node::Args args) const override {
      return MakeSourceNode(std::move(args));
    }

    // The state is the position in the epoch: how many items (batches or
    // per-batch errors) this iterator has handed out, and of a source made
    // of work units, what it handed out of each (Progress). A restored
    // iterator asks its source for the epoch from there: a source of units
    // starts each where it was; another passes over `position` items, so it
    // must yield the same items in the same order when rebuilt.
    absl::Status SaveInternal(SerializationContext* ctx,
                              IteratorStateWriter* writer) override {
      tensorflow::mutex_lock l(mu_);
      TF_RETURN_IF_ERROR(writer->WriteScalar(prefix(), kPosition, position_));
      TF_RETURN_IF_ERROR(
          writer->WriteScalar(prefix(), kExhausted, exhausted_ ? 1 : 0));
      TF_RETURN_IF_ERROR(writer->WriteScalar(prefix(), kCardinality,
                                             dataset()->info_.cardinality));
      const std::vector<int64_t> progress = progress_.Encode();
      Tensor encoded(tensorflow::DT_INT64,
                     {static_cast<int64_t>(progress.size())});
      std::copy(progress.begin(), progress.end(),
                encoded.flat<int64_t>().data());
      TF_RETURN_IF_ERROR(writer->WriteTensor(prefix(), kProgress, encoded));
      const std::string info =
          channel_ != nullptr ? channel_->resume_info() : resume_info_;
      return writer->WriteScalar(prefix(), kResumeInfo,
                                 tensorflow::tstring(info));
    }

    absl::Status RestoreInternal(IteratorContext* ctx,
                                 IteratorStateReader* reader) override {
      tensorflow::mutex_lock l(mu_);
      int64_t position = 0, exhausted = 0, cardinality = 0;
      TF_RETURN_IF_ERROR(reader->ReadScalar(prefix(), kPosition, &position));
      TF_RETURN_IF_ERROR(reader->ReadScalar(prefix(), kExhausted, &exhausted));
      TF_RETURN_IF_ERROR(
          reader->ReadScalar(prefix(), kCardinality, &cardinality));
      const int64_t own = dataset()->info_.cardinality;
      if (cardinality >= 0 && own >= 0 && cardinality != own) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tfray: the checkpoint was saved from a dataset of ", cardinality,
            " batches, but this one has ", own,
            ". Restore into a tfray.Dataset built from the same batches."));
      }
      if (position < 0 || (own >= 0 && position > own)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tfray: the checkpoint's position ", position,
            " is outside this dataset's ", own, " batches."));
      }
      // A checkpoint saved before units were tracked has no progress: its
      // epoch resumes by passing over `position` items.
      Progress progress;
      if (reader->Contains(prefix(), kProgress)) {
        Tensor encoded;
        TF_RETURN_IF_ERROR(reader->ReadTensor(prefix(), kProgress, &encoded));
        if (encoded.dtype() != tensorflow::DT_INT64 || encoded.dims() != 1) {
          return absl::InvalidArgumentError(
              "tfray: the checkpoint's progress is not a vector of int64.");
        }
        const auto flat = encoded.flat<int64_t>();
        if (!progress.Decode(std::vector<int64_t>(flat.data(),
                                                  flat.data() + flat.size()))) {
          return absl::InvalidArgumentError(
              "tfray: the checkpoint's progress is malformed; it was not "
              "written by tfray.");
        }
      }
      tensorflow::tstring info;
      if (reader->Contains(prefix(), kResumeInfo)) {
        TF_RETURN_IF_ERROR(reader->ReadScalar(prefix(), kResumeInfo, &info));
      }
      position_ = position;
      exhausted_ = exhausted != 0;
      progress_ = std::move(progress);
      resume_info_ = std::string(info);
      return absl::OkStatus();
    }

   private:
    // Wraps each array as a tensor that aliases it. The feeder has already
    // checked the batch against the element spec and made anything
    // unaligned or non-contiguous into an aligned copy; these checks guard
    // memory safety, not user input.
    absl::Status ToTensors(const Batch& batch, std::vector<Tensor>* out) {
      const DataTypeVector& types = dataset()->output_types_;
      const auto& shapes = dataset()->output_shapes_;
      if (batch.arrays.size() != types.size()) {
        return absl::InternalError(
            absl::StrCat("tfray: batch has ", batch.arrays.size(),
                         " arrays, expected ", types.size()));
      }
      out->reserve(types.size());
      for (size_t i = 0; i < types.size(); ++i) {
        const ArrayRef& a = batch.arrays[i];
        const DataType dtype = static_cast<DataType>(a.dtype);
        TensorShape shape;
        TF_RETURN_IF_ERROR(TensorShape::BuildTensorShape(a.shape, &shape));
        if (dtype != types[i] || !shapes[i].IsCompatibleWith(shape)) {
          return absl::InternalError(absl::StrCat(
              "tfray: component ", i, " is ", DataTypeString(dtype),
              shape.DebugString(), ", expected ", DataTypeString(types[i]),
              shapes[i].DebugString()));
        }
        const size_t expected_bytes =
            shape.num_elements() * tensorflow::DataTypeSize(dtype);
        if (a.nbytes != expected_bytes) {
          return absl::InternalError(
              absl::StrCat("tfray: component ", i, " has ", a.nbytes,
                           " bytes, expected ", expected_bytes));
        }
        if (a.nbytes == 0) {
          out->emplace_back(dtype, shape);
          continue;
        }
        if (!IsAligned(a.data, TFRAY_TENSOR_ALIGNMENT)) {
          return absl::InternalError(absl::StrCat(
              "tfray: component ", i, " is not aligned to ",
              TFRAY_TENSOR_ALIGNMENT, " bytes"));
        }
        // A buffer no kernel can forward to its output and write into.
        out->emplace_back(
            dtype, std::move(shape),
            MakeBatchBuffer(const_cast<void*>(a.data), a.nbytes, batch.token));
      }
      return absl::OkStatus();
    }

    absl::Status NotRegistered() const {
      return absl::NotFoundError(absl::StrCat(
          "tfray source ", dataset()->key_,
          " is no longer registered: its tfray.Dataset was garbage "
          "collected. Keep a reference to the tfray.Dataset while its "
          "pipeline is in use."));
    }

    static constexpr const char* const kPosition = "position";
    static constexpr const char* const kExhausted = "exhausted";
    static constexpr const char* const kCardinality = "cardinality";
    static constexpr const char* const kProgress = "progress";
    static constexpr const char* const kResumeInfo = "resume_info";

    // The channel an iterator reads, shared with its cancellation callback.
    // It is known from the first GetNext on: the iterator's own, or one the
    // dispatcher offered, already filling with this epoch.
    class Reading {
     public:
      void Set(std::shared_ptr<Channel> channel) {
        std::lock_guard<std::mutex> lock(mu_);
        channel_ = std::move(channel);
        if (cancelled_) channel_->Cancel();
      }
      void Cancel() {
        std::lock_guard<std::mutex> lock(mu_);
        cancelled_ = true;
        if (channel_) channel_->Cancel();
      }

     private:
      std::mutex mu_;
      std::shared_ptr<Channel> channel_;  // Guarded by mu_.
      bool cancelled_ = false;            // Guarded by mu_.
    };

    const std::shared_ptr<Reading> reading_;
    std::function<void()> deregister_fn_;
    bool deterministic_ = true;
    tensorflow::mutex mu_;
    // Null until the first GetNext asks for the epoch.
    std::shared_ptr<Channel> channel_ TF_GUARDED_BY(mu_);
    bool exhausted_ TF_GUARDED_BY(mu_) = false;
    int64_t position_ TF_GUARDED_BY(mu_) = 0;
    // Per work unit, what was handed out (channel.h): where a restored
    // epoch starts each unit.
    Progress progress_ TF_GUARDED_BY(mu_);
    // The restored checkpoint's Channel::resume_info, until the epoch's
    // channel says its own.
    std::string resume_info_ TF_GUARDED_BY(mu_);
  };

  const int64_t key_;
  const SourceRegistry::SourceInfo info_;
  const DataTypeVector output_types_;
  const std::vector<PartialTensorShape> output_shapes_;
};

TfrayDatasetOp::TfrayDatasetOp(OpKernelConstruction* ctx)
    : DatasetOpKernel(ctx) {
  OP_REQUIRES_OK(ctx, ctx->GetAttr(kOutputTypes, &output_types_));
  OP_REQUIRES_OK(ctx, ctx->GetAttr(kOutputShapes, &output_shapes_));
}

void TfrayDatasetOp::MakeDataset(OpKernelContext* ctx, DatasetBase** output) {
  int64_t key = 0;
  OP_REQUIRES_OK(ctx, tensorflow::data::ParseScalarArgument<int64_t>(
                          ctx, kSourceKey, &key));
  SourceRegistry::SourceInfo info;
  OP_REQUIRES(ctx, SourceRegistry::Global().Lookup(key, &info),
              absl::NotFoundError(absl::StrCat(
                  "tfray source ", key,
                  " is not registered in this process. A tfray dataset "
                  "graph can only be instantiated in the process that "
                  "created its tfray.Dataset, while that object is alive.")));
  *output = new Dataset(ctx, key, info, output_types_, output_shapes_);
}

namespace {
REGISTER_KERNEL_BUILDER(Name("TfrayDataset").Device(tensorflow::DEVICE_CPU),
                        TfrayDatasetOp);
}  // namespace

}  // namespace tfray
