// Package tritonpb holds the protobuf messages of Triton's model
// configuration (model_config.proto), with Triton's names and field numbers
// for the part sloserve serves: configs reads a config.pbtxt into them, and
// the ModelConfig endpoints answer with them. Generated code only.
package tritonpb
