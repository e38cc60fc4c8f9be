"""Generated from proto/epp/admin/v1/admin.proto by `make proto`; do not edit."""
