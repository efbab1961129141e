// Package inference is the Open Inference Protocol v2 gRPC service as
// sloserve speaks it: grpc_service.proto, model_config.proto (Triton's model
// config, also the format of a config.pbtxt) and the Go code protoc
// generates from them, checked in.
//
// It owns the wire format only: message and field names and numbers follow
// the public OIP v2 / KServe v2 specification and Triton's superset of it.
// It must hold no hand-written logic and the generated files must never be
// edited by hand: change the .proto and run `make proto`, which regenerates
// them with pinned plugin versions. The handlers that serve the service live
// in package api.
package inference
