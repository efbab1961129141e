// Package modelmesh is ModelMesh's model-runtime SPI as sloserve serves it:
// model_runtime.proto and the Go code protoc generates from it
// (model_runtime.pb.go, model_runtime_grpc.pb.go), checked in.
//
// It owns the wire format only: package, service, message and field names
// and numbers follow kserve/modelmesh's public model-runtime.proto. It must
// hold no hand-written logic and the generated files must never be edited
// by hand: change the .proto and run `make proto`. The handlers live in
// package api (modelmesh.go).
package modelmesh
