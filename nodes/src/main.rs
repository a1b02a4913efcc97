//! The `troupe` command line.

fn main() {
    println!("troupe");
}
